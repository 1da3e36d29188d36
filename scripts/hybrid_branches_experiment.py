"""How many branches of a draft tree a hybrid target should read (target.recurrent_branches).

A target with recurrent layers reads a tree as its branches, a copy of the row's cache each
(verifier/branches.py). What that buys is acceptance; what it costs is a wider pass and the
copies. Neither is measurable on one model here: no hybrid with a drafter trained for it is
bundled. So the two are measured apart, and put together as an estimate:

  acceptance  the bundled (attention) target with its trained drafters, greedy, held-out prompts:
              tau when each round's tree is cut to its first 1, 2, 4 branches
              (DraftTree.first_branches, as the engine cuts it for a hybrid), output checked equal
              to plain decoding's
  cost        a random Qwen3.5 hybrid of hidden 512, 8 layers, 32k vocabulary (the shape of
              scripts/hybrid_verify_cost.py): after a 512-token prefill, one target pass + accept
              over the root and B branches of 6 tokens per row (B = 1, 2, 4), batch 1 and 4,
              median of repeats, interleaved; and a plain one-token step
  estimate    tokens per second relative to plain decoding, tau / (pass ms / step ms), ignoring
              the drafter's own time (the same for every B: it drafts the whole tree anyway)

    python scripts/hybrid_branches_experiment.py [--prompts 8] [--max-new-tokens 96] [--repeats 15]
    python scripts/hybrid_branches_experiment.py --device cuda --branches 1 2 4 8   # on a GPU
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import draftsman
from draftsman import zoo
from draftsman.demo import demo_drafters
from draftsman.prompts import heldout_prompts
from draftsman.verifier.cached_model import CachedLM
from draftsman.verifier.prefill import Prefill
from draftsman.verifier.tree import TreeBlock

from hybrid_verify_cost import models

DEPTH = 6
PREFILL = 512
DRAFTERS = ("ngram", "eagle", "eagle3")


def acceptance(prompts: int, max_new_tokens: int, widths: list[int], device: str) -> dict[str, dict[int, float]]:
    """{drafter: {branches: tau}} on the bundled target, each round's trees cut to that many branches."""
    base = draftsman.load({"target": {"path": str(zoo.target_path()), "device": device}})
    ids = heldout_prompts(base.tokenizer, prompts)
    plain = [base.generate(input_ids=[p], max_new_tokens=max_new_tokens).token_ids[0] for p in ids]
    configs = demo_drafters(base.device)
    out = {}
    for name in DRAFTERS:
        dec = base.with_drafter(configs[name])
        propose = dec.drafter.propose
        out[name] = {}
        for branches in widths:
            dec.drafter.propose = lambda contexts, n=branches: [t.first_branches(n) for t in propose(contexts)]
            accepted = rounds = 0
            for p, expected in zip(ids, plain):
                res = dec.generate(input_ids=[p], max_new_tokens=max_new_tokens)
                assert res.token_ids[0] == expected, (name, branches)  # exact at every width
                accepted += sum(n for row in res.stats.accepted_per_round for n in row)
                rounds += sum(len(row) for row in res.stats.accepted_per_round)  # per row: its rounds
            out[name][branches] = 1 + accepted / rounds
        del dec.drafter.propose
    return out


def tree_block(rows: int, branches: int, device) -> TreeBlock:
    """Per row the root, then `branches` chains of DEPTH tokens hanging off it."""
    tokens = [7] + [11 + j for _ in range(branches) for j in range(DEPTH)]
    parents = [-1] + [0 if j == 0 else 1 + b * DEPTH + j - 1 for b in range(branches) for j in range(DEPTH)]
    T = len(tokens)
    return TreeBlock(torch.tensor([tokens] * rows, device=device), torch.tensor([parents] * rows, device=device),
                     torch.ones(rows, T, dtype=torch.bool, device=device))


def costs(repeats: int, widths: list[int], device: str) -> dict[int, dict[int, float]]:
    """{batch: {branches: median ms of a pass + accept; 0: a plain one-token step}} on the random hybrid."""
    if device == "cpu":
        torch.set_num_threads(2)  # this machine's cores; a GPU run leaves torch's own default
    lm = CachedLM(models()["qwen3.5 (hybrid)"].to(device).eval())
    prompt = list(range(100, 100 + PREFILL))
    out = {}
    for rows in (1, 4):
        times = {b: [] for b in (0, *widths)}
        for _ in range(repeats):
            for b in times:  # interleaved: the machine's drift hits all alike
                prefill = Prefill(lm, [prompt + [0]] * rows, (), device)
                prefill.step()
                prefill.finish()
                block = tree_block(rows, b, device) if b else TreeBlock.column(torch.full((rows,), 7, device=device))
                keep = [0, 1 + (b - 1) * DEPTH, 2 + (b - 1) * DEPTH] if b else [0]  # 2 drafts of the last branch
                sync(device)
                start = time.perf_counter()
                lm.forward(block)
                lm.accept([keep] * rows)
                sync(device)
                times[b].append((time.perf_counter() - start) * 1000)
        out[rows] = {b: statistics.median(t) for b, t in times.items()}
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--branches", type=int, nargs="+", default=[1, 2, 4], help="widths B (default 1 2 4)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()
    widths = args.branches
    taus = acceptance(args.prompts, args.max_new_tokens, widths, args.device)
    print(f"\ntau on the bundled target, trees cut to B branches ({args.prompts} held-out prompts, "
          f"{args.max_new_tokens} new tokens, greedy; output = plain decoding's at every B)")
    print("| drafter | " + " | ".join(f"B={b}" for b in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name, row in taus.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.2f}" for b in widths) + " |")
    ms = costs(args.repeats, widths, args.device)
    where = "2 CPU threads" if args.device == "cpu" else args.device
    print(f"\nrandom Qwen3.5 hybrid (hidden 512, 8 layers), {PREFILL}-token context, {where}: median ms of "
          f"a pass + accept over the root and B branches of {DEPTH} (plain step: one token), {args.repeats} repeats")
    print("| batch | plain step | " + " | ".join(f"B={b}" for b in widths) + " |")
    print("|---|---|" + "---|" * len(widths))
    for rows, row in ms.items():
        print(f"| {rows} | {row[0]:.1f} | " + " | ".join(f"{row[b]:.1f} ({row[b] / row[0]:.2f}x)" for b in widths)
              + " |")
    print("\nestimate: tokens/s over plain decoding = tau / (pass ms / step ms), drafting time left out")
    print("| drafter | batch | " + " | ".join(f"B={b}" for b in widths) + " |")
    print("|---|---|" + "---|" * len(widths))
    for name, row in taus.items():
        for rows, cost in ms.items():
            print(f"| {name} | {rows} | " + " | ".join(f"{row[b] / (cost[b] / cost[0]):.2f}x" for b in widths)
                  + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
