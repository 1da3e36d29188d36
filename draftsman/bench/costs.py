"""The cost side of the speculation bet, measured on this machine: how long one target pass takes
as a function of batch size and tokens per row, and what acceptance a drafter needs to pay.

    python -m draftsman.bench.costs [--target zoo/python-target] [--batches 1 4 16] [--tokens 1 2 4 8 16]

A round that verifies d drafted levels per row costs draft(d) + verify(B, 1 + nodes) and emits
E(d) = 1 + a + a^2 + ... + a^d tokens per row (constant acceptance a per level). Plain decoding
emits 1 token per verify(B, 1). The break-even acceptance for a chain of depth d is the a where
E(d) / (verify(B, 1 + d) + draft(d)) = 1 / verify(B, 1); this prints it for a free drafter
(draft = 0), which is the best any drafter can do. docs/choosing-a-drafter.md quotes the output.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..models import load_causal_lm
from ..verifier.cached_model import CachedLM
from ..verifier.engine import synchronize
from ..verifier.tree import TreeBlock


def time_pass(model, batch: int, tokens: int, cached: int, repeats: int) -> float:
    """Median seconds of one forward of `tokens` chain tokens per row over a `cached`-token cache."""
    lm = CachedLM(model)
    lm.reset(batch)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (batch, cached), generator=g).tolist()
    lm.forward(TreeBlock.chains(prefix, lm.device), logits_at=torch.zeros(batch, dtype=torch.long))
    lm.accept([list(range(cached))] * batch)
    block = TreeBlock.chains(torch.randint(0, model.config.vocab_size, (batch, tokens), generator=g).tolist(),
                             lm.device)
    times = []
    for _ in range(repeats + 1):
        synchronize(lm.device)
        t0 = time.perf_counter()
        lm.forward(block)
        synchronize(lm.device)  # CUDA runs asynchronously: without this only the launches are timed
        times.append(time.perf_counter() - t0)
        lm.accept([[] for _ in range(batch)])  # keep none: every repeat sees the same cache (a hybrid's state too)
    return statistics.median(times[1:])


def break_even(verify_plain: float, verify_d: float, depth: int) -> float:
    """Per-level acceptance a at which a free chain of `depth` drafts ties plain decoding."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        expected = sum(a ** j for j in range(depth + 1))
        if expected / verify_d > 1 / verify_plain:
            hi = a
        else:
            lo = a
    return hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsman.bench.costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="target folder (default: the bundled zoo/python-target)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--cached", type=int, default=300, help="tokens already in the cache")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.tokens[0] != 1:
        ap.error("--tokens must start with 1 (the plain decoding step everything is compared with)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from .. import zoo
    target = args.target or str(zoo.target_path())
    model = load_causal_lm(target, "float32", "cpu" if not torch.cuda.is_available() else "cuda", what="--target")
    table = {B: {T: time_pass(model, B, T, args.cached, args.repeats) for T in args.tokens} for B in args.batches}
    if args.json:
        print(json.dumps({"target": target, "cached": args.cached, "seconds": table}))
        return 0
    print(f"target {target}, {args.cached} cached tokens, torch threads {torch.get_num_threads()}; "
          "one target pass, ms (x plain step):")
    print("| batch | " + " | ".join(f"{T} tok/row" for T in args.tokens) + " |")
    print("|---|" + "---|" * len(args.tokens))
    for B, row in table.items():
        plain = row[args.tokens[0]]
        print(f"| {B} | " + " | ".join(f"{1000 * t:.1f} ({t / plain:.2f}x)" for t in row.values()) + " |")
    print("\nbreak-even acceptance per level for a free chain drafter of depth d (1 + d tokens per row):")
    print("| batch | " + " | ".join(f"d={T - 1}" for T in args.tokens[1:]) + " |")
    print("|---|" + "---|" * (len(args.tokens) - 1))
    for B, row in table.items():
        plain = row[args.tokens[0]]
        print(f"| {B} | " + " | ".join(f"{break_even(plain, row[T], T - 1):.2f}" for T in args.tokens[1:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
