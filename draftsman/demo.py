"""`draftsman demo` (`make demo`): real speculative decoding on the bundled models, offline.

Plain decoding (`none`), prompt lookup (`ngram`) and the bundled draft model (`draft_model`) run
side by side on held-out Python prompts, interleaved prompt by prompt so machine noise hits them
alike; the table gives tokens/s, speedup over plain, tau and per-position acceptance, and checks
that at temperature 0 every drafter's output equals plain decoding's.
"""
from __future__ import annotations

import argparse
import time

from . import load, zoo
from .prompts import heldout_prompts


def demo_drafters() -> dict[str, dict]:
    return {
        "none": {"name": "none"},
        "ngram": {"name": "ngram", "k": 4},
        "draft_model": {"name": "draft_model", "path": str(zoo.draft_path()), "k": 4},
    }


def run(prompts: int, max_new_tokens: int, temperature: float, repeats: int, seed: int) -> dict:
    base = load({"target": {"path": str(zoo.target_path())}, "drafter": {"name": "none"}})
    decoders = {name: base.with_drafter(cfg) for name, cfg in demo_drafters().items()}
    ids = heldout_prompts(base.tokenizer, prompts)
    for dec in decoders.values():  # warm-up: first calls pay for allocations
        dec.generate(input_ids=ids[:1], max_new_tokens=8, temperature=temperature, seed=seed)
    totals = {n: {"seconds": 0.0, "tokens": 0, "row_rounds": 0, "acc": [], "prop": [], "outputs": []}
              for n in decoders}
    order = list(decoders)
    for rep in range(repeats):
        for i, prompt in enumerate(ids):
            for name in (order if (rep + i) % 2 == 0 else order[::-1]):  # A B C, C B A, ...
                t0 = time.perf_counter()
                out = decoders[name].generate(input_ids=[prompt], max_new_tokens=max_new_tokens,
                                              temperature=temperature, seed=seed + i)
                t = totals[name]
                t["seconds"] += time.perf_counter() - t0
                t["tokens"] += len(out.token_ids[0])
                t["row_rounds"] += out.stats.row_rounds
                _add(t["acc"], out.stats.accepted_at_depth)
                _add(t["prop"], out.stats.proposed_at_depth)
                if rep == 0:
                    t["outputs"].append(out.token_ids[0])
    plain = totals["none"]["tokens"] / totals["none"]["seconds"]
    rows = {}
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        rows[name] = {
            "tokens_per_s": tps, "speedup": tps / plain, "tau": t["tokens"] / t["row_rounds"],
            "acceptance": [a / p if p else 0.0 for a, p in zip(t["acc"], t["prop"])],
            "same_as_plain": sum(o == p for o, p in zip(t["outputs"], totals["none"]["outputs"])),
        }
    return {"rows": rows, "prompts": len(ids), "sample": base.tokenizer.decode(totals["draft_model"]["outputs"][0]),
            "sample_prompt": base.tokenizer.decode(ids[0][-120:])}


def _add(acc: list, values: list) -> None:
    acc.extend([0] * (len(values) - len(acc)))
    for d, v in enumerate(values):
        acc[d] += v


def format_table(result: dict, temperature: float) -> str:
    lines = ["| drafter | tokens/s | vs plain | tau | acceptance by depth | output = plain |",
             "|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        same = f"{r['same_as_plain']}/{result['prompts']}" if temperature == 0 else "n/a (sampling)"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {acc} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="draftsman demo", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the prompts (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
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
