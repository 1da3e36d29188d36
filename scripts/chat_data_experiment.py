"""The chat-data experiment of docs/training-heads.md, on the bundled code target.

No instruct model or chat dataset is reachable offline, so the bundled target plays one: a copy of
zoo/python-target gets a chat template in which the user's message is a function's signature and
docstring and the assistant's reply is its body (the target continues code well there). The data
comes from the corpus's training files, the evaluation prompts from its held-out files.

    python scripts/chat_data_experiment.py build --out-dir D            # D/target, D/train.jsonl, D/prompts.jsonl
    python scripts/chat_data_experiment.py tau --target D/target --heads H1 H2 ...   # T=0 tau per Medusa heads
"""
from __future__ import annotations

import argparse
import ast
import json
import shutil
import textwrap
from pathlib import Path

from draftsman.training import corpus as C

# The user's message is the code that asks; the reply (which starts with its newline, so the
# prompt does not end on a bare newline token) is the body that answers.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
            "{% else %}{{ m['content'] }}\n{{ eos_token }}{% endif %}{% endfor %}")


def conversations(files, limit: int) -> list[dict]:
    out = []
    for path in files:
        text = C.read_text(path)
        if text is None or C.EOT in text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(node.body) < 2:
                continue
            lines = textwrap.dedent("\n".join(text.splitlines()[node.lineno - 1: node.end_lineno])).split("\n")
            if len("\n".join(lines)) > 3000:
                continue
            body_at = node.body[1].lineno - node.lineno
            out.append({"messages": [{"role": "user", "content": "\n".join(lines[:body_at])},
                                     {"role": "assistant", "content": "\n" + "\n".join(lines[body_at:])}]})
            if len(out) >= limit:
                return out
    return out


def build(out_dir: Path, target: Path, train_limit: int, prompts: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    train_files, held_files = C.split_files()
    train = conversations(train_files, train_limit)
    (out_dir / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in train))
    held = conversations(held_files, 10 * prompts)[::10][:prompts]
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps({"messages": c["messages"][:1]}) + "\n" for c in held))
    copy = out_dir / "target"
    if not copy.exists():
        shutil.copytree(target, copy)
    (copy / "chat_template.jinja").write_text(TEMPLATE)
    print(f"{len(train)} training conversations, {len(held)} prompts, target with a template in {copy}")


def tau(target: Path, prompts: Path, heads: list[str], max_new_tokens: int) -> None:
    import draftsman

    conversations = [json.loads(line)["messages"] for line in prompts.read_text().splitlines()]
    base = draftsman.load({"target": {"path": str(target)}, "drafter": {"name": "none"}})
    for folder in heads:
        decoder = base.with_drafter({"name": "medusa", "path": folder})
        new = rounds = 0
        for conversation in conversations:  # one at a time: tau per row, no batching effects
            stats = decoder.chat(conversation, max_new_tokens=max_new_tokens, temperature=0).stats
            new, rounds = new + stats.new_tokens, rounds + stats.row_rounds
        print(f"{folder}: tau {new / rounds:.3f} ({new} tokens in {rounds} target passes)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out-dir", type=Path, required=True)
    b.add_argument("--target", type=Path, default=Path(__file__).resolve().parents[1] / "zoo" / "python-target")
    b.add_argument("--train", type=int, default=4000, help="training conversations")
    b.add_argument("--prompts", type=int, default=24, help="held-out prompts")
    t = sub.add_parser("tau")
    t.add_argument("--target", type=Path, required=True)
    t.add_argument("--prompts", type=Path, default=None, help="default: prompts.jsonl beside the target")
    t.add_argument("--heads", nargs="+", required=True)
    t.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    if args.command == "build":
        build(args.out_dir, args.target, args.train, args.prompts)
    else:
        tau(args.target, args.prompts or args.target.parent / "prompts.jsonl", args.heads, args.max_new_tokens)


if __name__ == "__main__":
    main()
