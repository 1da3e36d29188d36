"""`draftsman demo` (`make demo`): real speculative decoding on the bundled models, offline.

Plain decoding (`none`), the drafters that need no training (`ngram`: prompt lookup; `recycling`:
the target's own earlier candidates), the bundled draft model (`draft_model`) and the bundled heads
(`medusa`, `eagle`, `eagle3`, `mtp`, `mlp_speculator`) run side by side on held-out Python prompts, interleaved
prompt by prompt so machine noise hits them alike; the table gives tokens/s, speedup over plain (medians over repeats), tau and per-position
acceptance, and checks that at temperature 0 every drafter's output equals plain decoding's.
`draftsman compare` is the full version: categories, temperatures, peers, batch sweep, plots.
"""
from __future__ import annotations

import argparse
import math
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What the demo runs on (torch, transformers, the drafters) is imported where it runs, so that
# `draftsman demo --help` and a mistyped flag answer at once.


def demo_drafters(device: str | torch.device = "cpu") -> dict[str, dict]:
    """By label: `none`, `ngram`, `recycling` and every bundled drafter, as `draftsman compare` sets them up by
    default (draftsman/bench/config.py BUNDLED_DRAFTERS) for a target on `device`."""
    from .bench.config import default_drafters

    return {d.get("label", d["name"]): {k: v for k, v in d.items() if k != "label"}
            for d in default_drafters(device)}


def run(prompts: int, max_new_tokens: int, temperature: float, repeats: int, seed: int) -> dict:
    from . import load, zoo
    from .bench.runner import Ours, time_interleaved
    from .prompts import heldout_prompts

    base = load({"target": {"path": str(zoo.target_path())}, "drafter": {"name": "none"}})
    contenders = [Ours(name, base if name == "none" else base.with_drafter(cfg))
                  for name, cfg in demo_drafters(base.device).items()]
    ids = heldout_prompts(base.tokenizer, prompts)
    # The same interleaved loop as `draftsman compare` (warm-up, A B C / C B A, median of repeats).
    tallies = time_interleaved(contenders, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                               repeats=repeats, seed=seed)
    plain = tallies["none"]
    rows = {}
    for name, t in tallies.items():
        rows[name] = {
            "tokens_per_s": t.tokens_per_s, "speedup": statistics.median(t.speedups(plain)), "tau": t.tau,
            "acceptance": t.acceptance,
            "same_as_plain": sum(o == p for o, p in zip(t.outputs, plain.outputs)),
        }
    return {"rows": rows, "prompts": len(ids), "sample": base.tokenizer.decode(tallies["draft_model"].outputs[0]),
            "sample_prompt": base.tokenizer.decode(ids[0][-120:])}


def format_table(result: dict, temperature: float) -> str:
    lines = ["| drafter | tokens/s | vs plain | tau | acceptance by depth | output = plain |",
             "|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        same = f"{r['same_as_plain']}/{result['prompts']}" if temperature == 0 else "n/a (sampling)"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {acc} | {same} |")
    return "\n".join(lines)


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checked before the models load: bad values failed only after it, and --prompts 0 ran every prompt."""
    for flag in ("prompts", "max_new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be an integer >= 1, got {getattr(args, flag)}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        ap.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsman demo", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    _check(ap, args)
    from . import zoo

    print(f"target {zoo.target_path()}\ndraft  {zoo.draft_path()}")
    result = run(args.prompts, args.max_new_tokens, args.temperature, args.repeats, args.seed)
    print(f"\n{result['prompts']} held-out prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}, batch 1\n")
    print(format_table(result, args.temperature))
    print("\n--- prompt (end) ---\n" + result["sample_prompt"] + "\n--- draft_model continuation ---\n" + result["sample"])
    bad = [n for n, r in result["rows"].items() if args.temperature == 0 and r["same_as_plain"] != result["prompts"]]
    if bad:
        print(f"\nERROR: at temperature 0 these drafters changed the output: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
