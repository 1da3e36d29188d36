"""A/B in one process: a mixed batch (2 rows at T=0.7, 2 greedy; or, with `penalties`, 2 greedy
rows with presence penalty 1.0 and frequency penalty 0.5, 2 without; or, with `biases`, 2 greedy
rows that ban the newline token, 2 without) with drafts drawn, penalised and biased under each
row's own settings (the default) and under the request's one setting (the drafter's row settings
withheld, as before per-row drafts), alternating, 4 runs each. Prints tokens/s, tau and the
drafting and verification time per round.

    python scripts/mixed_batch_drafts.py eagle3              # or draft_model, medusa
    python scripts/mixed_batch_drafts.py eagle3 penalties    # or biases
"""
import json
import sys

import draftsman

SPECS = {
    "eagle3": {"name": "eagle", "path": "zoo/python-eagle3", "quantize": "auto", "min_confidence": 0.05,
               "depth": 6, "total_tokens": 20},
    "draft_model": {"name": "draft_model", "path": "zoo/python-draft", "k": 4, "quantize": "auto"},
    "medusa": {"name": "medusa", "path": "zoo/python-medusa"},
}
TEMPERATURES = [0.7, 0.0, 0.7, 0.0]
PENALTIES = {"temperature": 0.0, "presence_penalty": [1.0, None, 1.0, None],
             "frequency_penalty": [0.5, None, 0.5, None]}
NEWLINE = 199  # a lone "\n" in the bundled tokenizer
BIASES = {"temperature": 0.0, "logit_bias": [{NEWLINE: -100}, None, {NEWLINE: -100}, None]}


def main(name: str, mix: str) -> None:
    records = [json.loads(line) for line in open("draftsman/bench/data/prompts.jsonl")][1:]
    prompts = [r["text"] for r in records][: len(TEMPERATURES)]
    spec = {**SPECS[name], "penalise_drafts": True} if name == "draft_model" else SPECS[name]
    decoder = draftsman.load({"target": {"path": "zoo/python-target"}, "drafter": spec})
    settings = {"penalties": PENALTIES, "biases": BIASES}.get(mix, {"temperature": TEMPERATURES})
    drafter, mode = decoder.engine.drafter, {"now": "own"}
    propose = drafter.propose

    def proposing(contexts):
        if mode["now"] == "shared":
            drafter.row_sampling = None  # the request's setting for every row
        return propose(contexts)

    drafter.propose = proposing
    decoder.generate(prompts, max_new_tokens=16, **settings)  # warm-up
    runs = {"shared": [], "own": []}
    for rep in range(4):
        for now in ("shared", "own") if rep % 2 == 0 else ("own", "shared"):
            mode["now"] = now
            s = decoder.generate(prompts, max_new_tokens=96, seed=rep, ignore_eos=True, **settings).stats
            runs[now].append((s.new_tokens / s.total_seconds, s.tau, 1e3 * s.draft_seconds / s.rounds,
                              1e3 * s.verify_seconds / s.rounds))
    for now, values in runs.items():
        mean = [sum(v[i] for v in values) / len(values) for i in range(4)]
        print(f"{name} ({mix}) drafts under {now:6s} settings: {mean[0]:.1f} tokens/s, tau {mean[1]:.2f}, "
              f"draft {mean[2]:.2f} ms/round, verify {mean[3]:.2f} ms/round")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "eagle3", sys.argv[2] if len(sys.argv) > 2 else "temperatures")
