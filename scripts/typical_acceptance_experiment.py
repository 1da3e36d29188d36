"""What LOSSY typical acceptance buys and costs on the bundled target (docs/choosing-a-drafter.md).

For each drafter and temperature, exact verification and typical acceptance (Medusa's defaults)
run prompt by prompt beside plain decoding, in an order that flips every prompt, with the same
seed. Printed per row: tau, tokens/s over plain decoding (median of per-prompt ratios), and the
mean log-probability the target gives its own output tokens (raw distribution): typical
acceptance keeps drafts the target finds likely, so this rises above what sampling gives.

    python scripts/typical_acceptance_experiment.py [--per-category 4] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers.utils import logging as hf_logging

import draftsman
from draftsman.bench.config import BUNDLED_PROMPTS
from draftsman.bench.prompts_set import by_category, read_prompts

ZOO = Path(__file__).resolve().parent.parent / "zoo"
DRAFTERS = {
    "ngram": {"name": "ngram"},
    "medusa": {"name": "medusa", "path": str(ZOO / "python-medusa"), "draft_vocab": 1024, "tree_budget": 8},
    "eagle": {"name": "eagle", "path": str(ZOO / "python-eagle"), "draft_vocab": 1024, "dtype": "auto"},
    "eagle3": {"name": "eagle", "path": str(ZOO / "python-eagle3"), "quantize": "int8", "depth": 6,
               "total_tokens": 20, "sampled_depth": 5, "min_confidence": 0.05},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0.7,1")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    prompts, _ = read_prompts(BUNDLED_PROMPTS)
    texts = [p.text for ps in by_category(prompts, per_category=args.per_category).values() for p in ps]
    plain = draftsman.load({"target": {"path": str(ZOO / "python-target")}})
    ids = plain.encode(texts)
    print(f"{len(ids)} prompts x {args.max_new_tokens} new tokens, typical acceptance at Medusa's defaults "
          "(posterior_threshold 0.09, posterior_alpha 0.3)\n")
    print("| drafter | T | verification | tau | vs plain | mean target logprob |")
    print("|---|---|---|---|---|---|")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for name in args.drafters.split(","):
            dec = plain.with_drafter(DRAFTERS[name])
            runs = {"plain": (plain, False), "exact": (dec, False), "typical (LOSSY)": (dec, True)}
            seconds = {k: [] for k in runs}
            tokens = {k: 0 for k in runs}
            passes = {k: 0 for k in runs}
            logprob = {k: [] for k in runs}
            dec.generate(input_ids=ids[:1], max_new_tokens=8, temperature=temperature)  # warm-up
            for i, prompt in enumerate(ids):
                order = list(runs) if i % 2 == 0 else list(runs)[::-1]
                for key in order:
                    decoder, lossy = runs[key]
                    t0 = time.perf_counter()
                    out = decoder.generate(input_ids=[prompt], max_new_tokens=args.max_new_tokens,
                                           temperature=temperature, seed=i, logprobs=True,
                                           lossy_typical_acceptance=lossy)
                    seconds[key].append(time.perf_counter() - t0)
                    tokens[key] += out.stats.new_tokens
                    passes[key] += out.stats.row_rounds
                    logprob[key] += out.logprobs[0]
                    seconds[key][-1] /= max(out.stats.new_tokens, 1)  # seconds per token
            for key in ("exact", "typical (LOSSY)"):
                ratio = statistics.median(p / s for p, s in zip(seconds["plain"], seconds[key]))
                print(f"| {name} | {temperature:g} | {key} | {tokens[key] / passes[key]:.2f} | {ratio:.2f}x | "
                      f"{statistics.fmean(logprob[key]):.3f} |")
        print(f"| none | {temperature:g} | plain | 1.00 | 1.00x | {statistics.fmean(logprob['plain']):.3f} |")


if __name__ == "__main__":
    main()
