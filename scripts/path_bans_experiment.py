"""A/B in one process: drafting under no_repeat_ngram_size with the drafts kept out of each
position's banned repeats (drafters/path_bans.py, the default) and without (PathBans switched off,
as before), alternating, 3 runs each, on the bundled target: 4 held-out prompts as one batch, 96
new tokens, T=0. Prints tokens/s and tau per drafter and n.

    python scripts/path_bans_experiment.py                    # eagle3, draft_model, mtp, ngram; n = 3, 5
    python scripts/path_bans_experiment.py eagle3,ngram 4
"""
import json
import sys

import draftsman
from draftsman.drafters import path_bans

SPECS = {
    "eagle3": {"name": "eagle", "path": "zoo/python-eagle3", "quantize": "auto", "min_confidence": 0.05,
               "depth": 6, "total_tokens": 20},
    "draft_model": {"name": "draft_model", "path": "zoo/python-draft", "k": 4, "quantize": "auto"},
    "mtp": {"name": "mtp", "path": "zoo/python-mtp"},
    "ngram": {"name": "ngram"},
}
RUNS = 3


def main(names: list[str], sizes: list[int]) -> None:
    records = [json.loads(line) for line in open("draftsman/bench/data/prompts.jsonl")][1:]
    prompts = [r["text"] for r in records][:4]
    aware = path_bans.PathBans.round
    switch = {"on": aware, "off": lambda self, sampling, contexts: None}
    for name in names:
        decoder = draftsman.load({"target": {"path": "zoo/python-target"}, "drafter": SPECS[name]})
        decoder.generate(prompts, max_new_tokens=16, no_repeat_ngram_size=3)  # warm-up
        for n in sizes:
            runs = {"off": [], "on": []}
            for rep in range(RUNS):
                for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    path_bans.PathBans.round = switch[mode]
                    s = decoder.generate(prompts, max_new_tokens=96, ignore_eos=True, no_repeat_ngram_size=n).stats
                    runs[mode].append((s.new_tokens / s.total_seconds, s.tau))
            path_bans.PathBans.round = aware
            (off_speed, off_tau), (on_speed, on_tau) = ([sum(v[i] for v in runs[m]) / RUNS for i in range(2)]
                                                        for m in ("off", "on"))
            print(f"{name:12s} no_repeat_ngram_size={n}: {off_speed:6.1f} -> {on_speed:6.1f} tokens/s "
                  f"({on_speed / off_speed:.2f}x), tau {off_tau:.2f} -> {on_tau:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(SPECS),
         [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [3, 5])
