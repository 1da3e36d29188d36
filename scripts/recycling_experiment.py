"""The `recycling` drafter (Token Recycling) measured side by side (docs/choosing-a-drafter.md).

One process, the bundled target, every drafter interleaved prompt by prompt (this machine's noise
hits them alike), batch 1, speed over plain decoding in the same pass:

  cold       the matrix emptied before every prompt (what `draftsman compare` times: each call
             starts from Drafter.forget_outputs())
  warm       the matrix kept from prompt to prompt, after a pass over --warm-prompts other
             held-out prompts (a server that has run a while: its matrix outlives requests)

at T=0 (outputs checked equal to plain decoding's) and T=1.

    python scripts/recycling_experiment.py --prompts 16 --warm-prompts 16 --max-new-tokens 64 \\
        --eagle3 zoo/python-eagle3

--rank-accuracy instead runs one `recycling` with a 120-node tree over the prompts at T=0 and
prints how often each candidate rank is accepted at each depth when its parent was (the table
drafters/recycling.py's DEFAULT_RANK_ACCURACY holds). --budgets 8,16,24 adds a drafter per
tree_budget.
"""
from __future__ import annotations

import argparse
import json
import time

import draftsman
from draftsman.prompts import heldout_prompts

TEMPERATURES = (0.0, 1.0)


def drafters(budgets: list[int], eagle3: str | None, extra: list[str]) -> dict[str, dict]:
    out = {"none": {"name": "none"}, "ngram": {"name": "ngram"},
           "suffix (no cache)": {"name": "suffix", "max_cached_requests": 0}}
    for budget in budgets:
        out[f"recycling {budget}"] = {"name": "recycling", "tree_budget": budget}
    out["recycling"] = {"name": "recycling"}
    out["recycling, no prompt seed"] = {"name": "recycling", "seed_from_prompt": False}
    out["ngram, then recycling"] = {"name": "cascade", "drafters": [{"name": "ngram"}, {"name": "recycling"}]}
    if eagle3:  # configs/bench-zoo-cpu.yaml's eagle3
        out["eagle3"] = {"name": "eagle", "path": eagle3, "quantize": "int8", "depth": 6, "total_tokens": 20,
                         "sampled_depth": 5, "min_confidence": 0.05}
    for item in extra:  # label=JSON config
        label, config = item.split("=", 1)
        out[label] = json.loads(config)
    return out


def side_by_side(decoders: dict, warm_ids: list[list[int]], ids: list[list[int]], max_new_tokens: int) -> dict:
    """{(start, temperature): {label: (speed over plain, tau)}}."""
    results = {}
    for start in ("cold", "warm"):
        for t_index, temperature in enumerate(TEMPERATURES):
            for decoder in decoders.values():
                decoder.drafter.forget_outputs()
                if start == "warm":  # teach the matrix on other prompts first
                    for prompt in warm_ids:
                        decoder.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=temperature)
            seconds, taus, outputs = dict.fromkeys(decoders, 0.0), {k: [] for k in decoders}, {k: [] for k in decoders}
            for i, prompt in enumerate(ids):
                for label, decoder in decoders.items():
                    if start == "cold":
                        decoder.drafter.forget_outputs()
                    t0 = time.perf_counter()
                    out = decoder.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=temperature,
                                           seed=1000 * t_index + i)
                    seconds[label] += time.perf_counter() - t0
                    taus[label].append(out.stats.tau)
                    outputs[label].append(out.token_ids)
            if temperature == 0.0:
                assert all(outputs[k] == outputs["none"] for k in decoders), "outputs differ from plain decoding"
            results[(start, temperature)] = {k: (seconds["none"] / seconds[k], sum(taus[k]) / len(taus[k]))
                                             for k in decoders}
    return results


def rank_accuracy(base, ids: list[list[int]], max_new_tokens: int) -> None:
    wide = base.with_drafter({"name": "recycling", "tree_budget": 120,
                              "rank_accuracy": [[0.5, 0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.07]] * 8})
    hits = [[0] * 8 for _ in range(8)]
    trials = [[0] * 8 for _ in range(8)]
    for prompt in ids:
        report = wide.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=0.0).stats.drafter_report
        for d, (accuracy, tried) in enumerate(zip(report["rank_accuracy"], report["rank_trials"])):
            for r, (a, t) in enumerate(zip(accuracy, tried)):
                trials[d][r] += t
                hits[d][r] += round(a * t) if t else 0
    print("rank_accuracy (depth rows, rank columns):")
    for d in range(8):
        if trials[d][0]:
            print("    [" + ", ".join(f"{h / t:.3f}" if t else "null" for h, t in zip(hits[d], trials[d])) + "],"
                  f"  # trials {trials[d]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="zoo/python-target")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--warm-prompts", type=int, default=16, help="other held-out prompts the warm matrix learns on")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="", help="comma-separated tree_budget values to add, e.g. 8,16,24")
    ap.add_argument("--eagle3", help="an EAGLE-3 head's folder, to compare with a trained drafter")
    ap.add_argument("--drafter", action="append", default=[], help="another drafter: LABEL=JSON config")
    ap.add_argument("--rank-accuracy", action="store_true", help="measure the rank table instead")
    args = ap.parse_args()
    base = draftsman.load({"target": {"path": args.target}, "drafter": {"name": "none"}})
    every = heldout_prompts(base.tokenizer, args.prompts + args.warm_prompts)
    ids, warm_ids = every[:args.prompts], every[args.prompts:]
    if args.rank_accuracy:
        rank_accuracy(base, ids, args.max_new_tokens)
        return
    budgets = [int(b) for b in args.budgets.split(",") if b]
    decoders = {label: base if label == "none" else base.with_drafter(config)
                for label, config in drafters(budgets, args.eagle3, args.drafter).items()}
    results = side_by_side(decoders, warm_ids, ids, args.max_new_tokens)
    print(f"{len(ids)} held-out prompts ({len(warm_ids)} others warm the matrix), {args.max_new_tokens} new tokens, "
          "batch 1; speed over plain decoding (same pass, interleaved), tau in brackets")
    width = max(map(len, decoders)) + 2
    print(f"{'':{width}s}" + "".join(f"{f'{start} T={t:g}':>16s}" for start, t in results))
    for label in decoders:
        print(f"{label:{width}s}" + "".join(f"{f'{cells[label][0]:.2f}x ({cells[label][1]:.2f})':>16s}"
                                            for cells in results.values()))
    print("greedy outputs equal plain decoding's at T=0")


if __name__ == "__main__":
    main()
