"""`draft_model` whose context is shorter than the rows: drafting from a window of each row's latest
tokens (drafters/context_window.py) against stopping, as the drafter did before, once a row and
its drafts no longer fit, and against plain decoding. The bundled draft model's context is cut
to `--draft-context` positions in a copy (its RoPE positions allow any), so 600- and 900-token
prompts outgrow it; with `adaptive: true` beside them (it drafts only where drafting pays); all
interleaved in one process, outputs equal (greedy).

    python scripts/draft_context_window_experiment.py
"""
import argparse
import inspect
import json
import json.decoder
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import draftsman
from draftsman.drafters.base import DraftTree


def stopping_at_the_context(propose):
    """The earlier drafter: no drafts once a row and k drafts outgrow the draft model's context."""
    def propose_or_stop(self, contexts):
        if max(len(c) for c in contexts) + self.k > self.context:
            return [DraftTree.empty(self.lm.device) for _ in contexts]
        return propose(contexts)
    return propose_or_stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo/python-target")
    parser.add_argument("--draft", default="zoo/python-draft")
    parser.add_argument("--draft-context", type=int, default=512)
    parser.add_argument("--lengths", type=int, nargs="+", default=[600, 900])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    short = Path(tempfile.mkdtemp()) / "draft"
    shutil.copytree(args.draft, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = args.draft_context
    (short / "config.json").write_text(json.dumps(config))
    base = draftsman.load({"target": {"path": args.target}})
    windowed = base.with_drafter({"name": "draft_model", "path": str(short), "k": 4})
    stopping = base.with_drafter({"name": "draft_model", "path": str(short), "k": 4})
    drafter = stopping.engine.drafter
    drafter.propose = types.MethodType(stopping_at_the_context(drafter.propose), drafter)
    adaptive = base.with_drafter({"name": "draft_model", "path": str(short), "k": 4, "adaptive": True})
    ways = {"plain": base, "draft_model, stopping at its context": stopping, "draft_model, window": windowed,
            "draft_model, window, adaptive": adaptive}
    text = "\n".join(inspect.getsource(m) for m in (argparse, json.decoder, statistics))
    source = base.tokenizer(text, verbose=False)["input_ids"]
    print(f"{args.target} + {args.draft} cut to {args.draft_context} positions, k 4, greedy, batch 1, "
          f"{args.prompts} prompts per length, {args.new} new tokens, {args.repeats} repeats interleaved")
    print("| prompt tokens | " + " | ".join(f"{w} tok/s (tau)" for w in ways) + " | window / stopping |")
    print("|---|" + "---|" * (len(ways) + 1))
    for length in args.lengths:
        prompts = [source[i * 997: i * 997 + length] for i in range(args.prompts)]
        speed, tau, outputs = ({w: [] for w in ways} for _ in range(3))
        for _ in range(args.repeats):
            for way, dec in ways.items():
                for prompt in prompts:
                    start = time.perf_counter()
                    out = dec.generate(input_ids=[prompt], max_new_tokens=args.new)
                    speed[way].append(len(out.token_ids[0]) / (time.perf_counter() - start))
                    tau[way].append(out.stats.tau)
                    outputs[way] += out.token_ids
        if len({str(o) for o in outputs.values()}) != 1:
            sys.exit(f"outputs differ at prompt length {length}")
        med = {w: statistics.median(speed[w]) for w in ways}
        cells = " | ".join(f"{med[w]:.1f} ({statistics.mean(tau[w]):.2f})" for w in ways)
        ratio = med["draft_model, window"] / med["draft_model, stopping at its context"]
        print(f"| {length} | {cells} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
