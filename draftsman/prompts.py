"""Benchmark prompts cut from held-out files of the bundled corpus (never trained on)."""
from __future__ import annotations

from pathlib import Path


def cut_prompt(text: str, tokenizer, prompt_tokens: int, at: float = 0.6) -> list[int] | None:
    """The `prompt_tokens` tokens before the line break nearest to `at` of the way into the text;
    None for files too short to give a full prompt."""
    cut = text.rfind("\n", 0, int(len(text) * at)) + 1
    if cut <= 0:
        return None
    ids = tokenizer(text[:cut])["input_ids"]
    return ids[-prompt_tokens:] if len(ids) >= prompt_tokens else None


def heldout_prompts(tokenizer, count: int, prompt_tokens: int = 256, files: list[Path] | None = None) -> list[list[int]]:
    """`count` prompts from the held-out split, one per file, in a fixed order."""
    if count < 1:  # (the loop below stops only at len == count: 0 read every file)
        raise ValueError(f"count must be >= 1 held-out prompt, got {count}")
    if files is None:
        from .zoo import heldout_files
        files = heldout_files()
    prompts = []
    for path in sorted(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = cut_prompt(text, tokenizer, prompt_tokens)
        if ids is not None:
            prompts.append(ids)
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out files give a {prompt_tokens}-token prompt; asked for {count}")
    return prompts
