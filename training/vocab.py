"""`draftsman vocab --target FOLDER --out FILE`: which tokens the target picks most (greedy), counted
on the training split of the corpus (or of a data_file), never on held-out text. A drafter with
`draft_vocab: N` keeps only the first N of that order in its LM head (drafters/draft_vocab.py).
Heads carry the order in their config.json already; a separate draft model gets it from this file (by default
`<draft model folder>/tokens_by_frequency.json`)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..atomic_files import replaced_whole
from ..config import read_json_object
from .heads_config import DEFAULTS  # not .heads, nor torch: `draftsman vocab --help` answers at once
from .threads import restores_torch_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the target model folder whose greedy picks are counted")
    # (the name is drafters/draft_vocab.py's ORDER_FILE, which imports torch; a test keeps them the same)
    p.add_argument("--out", required=True, help="JSON file to write, or a folder (then tokens_by_frequency.json in it)")
    p.add_argument("--corpus-root", default=None, help="text corpus (default: this interpreter's stdlib, "
                                                       "train split, as the bundled models use)")
    p.add_argument("--data-file", default=None, help="instead of --corpus-root: a JSONL of conversations or texts, "
                                                     "as heads training's data_file (training/documents.py)")
    p.add_argument("--assistant-only", action="store_true",
                   help="with --data-file: count only the picks inside assistant replies, as heads trained with "
                        "assistant_only_loss count them")
    p.add_argument("--tokens", type=int, default=DEFAULTS["eval_tokens"], help="training tokens the target reads")
    p.add_argument("--seq-len", type=int, default=256, help="window length of each target pass")
    p.add_argument("--work-dir", default=DEFAULTS["work_dir"], help="token caches of the corpus")
    p.add_argument("--threads", type=int, default=DEFAULTS["threads"])
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="also report the coverage of the first N tokens (the drafter's draft_vocab)")


def count(target: str, corpus_root: str | None, tokens: int, seq_len: int, work_dir: str,
          data_file: str | None = None, assistant_only: bool = False, draft_vocab: int | None = None) -> dict:
    import torch
    from transformers import AutoTokenizer

    from ..heads.common import target_fingerprint
    from ..models import check_model_folder, pretrained_text_model
    from .heads import target_token_frequencies, training_streams

    folder = check_model_folder(target, "--target")
    if corpus_root and data_file:
        raise ValueError("give --corpus-root (a folder of source files) or --data-file (a JSONL), not both")
    if assistant_only and not data_file:
        raise ValueError("--assistant-only counts inside the replies of a --data-file of conversations: "
                         "give --data-file, or drop --assistant-only")
    cfg = {**DEFAULTS, "target": str(folder), "corpus_root": corpus_root, "data_file": data_file,
           "eval_tokens": tokens, "seq_len": seq_len, "work_dir": work_dir, "assistant_only_loss": assistant_only,
           "draft_vocab": draft_vocab}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The target runs as heads training runs it (bf16 autocast), so the order matches the heads'.
    # Plain torch.autocast, not an Accelerator: its process-wide state would pin mixed precision
    # for any training later in the same process.
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    model = pretrained_text_model(folder, torch.float32, "target").to(device).eval()
    check_fits_target(model, seq_len, draft_vocab)  # before the corpus is tokenized
    train_stream, _, masks = training_streams(cfg, AutoTokenizer.from_pretrained(folder), check_heldout=False)
    frequent = target_token_frequencies(cfg, model, train_stream, autocast, masks[0] if masks else None)
    where = " inside assistant replies" if assistant_only else ""
    # frequent["tokens"]: what the sample held, fewer than --tokens on a short corpus
    return {"tokens_by_frequency": frequent["order"], "coverage": frequent["coverage"],
            "counted_on": f"greedy picks of {folder.name}{where} on {frequent['tokens']} training-split tokens "
                          f"(windows of {seq_len})",
            "target": target_fingerprint(model)}  # a drafter's vocab_order checks it, as heads' config.json


def check_fits_target(model, seq_len: int, draft_vocab: int | None) -> None:
    """What heads training refuses (heads.check_against_target), refused here by the flags' names: windows
    past the target's positions (picks it was never trained to make), a draft_vocab past its vocabulary."""
    from .heads import target_positions

    positions = target_positions(model)
    if positions is not None and seq_len > positions:
        raise ValueError(f"--seq-len {seq_len} is longer than the target's {positions} positions: the count would "
                         f"come from positions it was never trained on; set --seq-len <= {positions}")
    vocab = model.get_output_embeddings().weight.shape[0]
    if draft_vocab is not None and draft_vocab > vocab:
        raise ValueError(f"--draft-vocab {draft_vocab} is more than the target's {vocab} tokens: lower it")


ORDER_KEYS = {"tokens_by_frequency", "coverage", "counted_on", "target"}  # all an order file holds (count's result)


def check_replaceable(out: Path) -> None:
    """The order is written over an earlier order only: --out model/config.json (a slip for the
    model folder) must not replace the model's config, nor a heads folder's, which holds an order
    among its other keys."""
    if not out.exists():
        return
    found = read_json_object(out) or {}
    if "tokens_by_frequency" not in found:
        raise ValueError(f"--out '{out}' exists and holds no token order (no 'tokens_by_frequency'): the order "
                         "would replace it. Give the draft model's folder (the order goes in its "
                         "tokens_by_frequency.json) or a new file")
    if not set(found) <= ORDER_KEYS:
        raise ValueError(f"--out '{out}' holds more than a token order (also {sorted(set(found) - ORDER_KEYS)[:4]}): "
                         "a heads config.json, say, which the order would replace. Give the draft model's folder "
                         "(the order goes in its tokens_by_frequency.json) or a new file")


@restores_torch_threads
def run(args: argparse.Namespace) -> int:
    import torch

    from ..drafters.draft_vocab import ORDER_FILE

    if args.threads < 1 or args.seq_len < 2 or args.tokens < args.seq_len:  # (0 or -5 tokens counted a window)
        raise ValueError(f"need --threads >= 1 and --tokens >= --seq-len >= 2 (windows of --seq-len tokens are "
                         f"counted), got --threads {args.threads}, --tokens {args.tokens}, --seq-len {args.seq_len}")
    draft_vocab = getattr(args, "draft_vocab", None)  # (a Namespace a caller built before the flag has none)
    if draft_vocab is not None and draft_vocab < 1:
        raise ValueError(f"--draft-vocab must be >= 1 (the drafter's draft_vocab), got {draft_vocab}")
    out = Path(args.out)
    if out.is_dir() or args.out.endswith(("/", os.sep)):  # a folder, or one to make ("newdir/" wrote a file)
        out = out / ORDER_FILE
    check_replaceable(out)  # before the count, which takes hours on a large target
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    result = count(args.target, args.corpus_root, args.tokens, args.seq_len, args.work_dir, args.data_file,
                   args.assistant_only, draft_vocab)
    with replaced_whole(out) as tmp:  # a kill mid-write leaves no half file for a drafter to read
        tmp.write_text(json.dumps(result))
    print(f"wrote {out}: coverage of the target's picks by the first N tokens {result['coverage']}")
    return 0
