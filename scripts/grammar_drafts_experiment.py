"""Side by side in one process: drafting within the grammar against drafting free, under grammars
that change the bundled target's output (it writes Python; these hold it to JSON, or to code
without strings and comments). Plain decoding and five drafters, interleaved prompt by prompt:
6 held-out continuation prompts, 64 new tokens, T=0, batch 1. Prints tokens/s, the speedup over
plain decoding under the same grammar, tau, and how many outputs equal plain decoding's under the
same grammar (drafts only change speed; the output is the same either way).

    python scripts/grammar_drafts_experiment.py
"""
import statistics
from functools import partial

import draftsman
from draftsman.bench.config import INT8_EAGLE3_TREE
from structured_output_experiment import continuation_prompts, interleaved_runs  # beside this script

DRAFTERS = {
    "none": {"name": "none"},
    "ngram": {"name": "ngram"},
    "draft_model": {"name": "draft_model", "path": "zoo/python-draft", "k": 4, "draft_vocab": 1024,
                    "quantize": "auto"},
    "medusa": {"name": "medusa", "path": "zoo/python-medusa", "draft_vocab": 1024, "tree_budget": 8},
    "mtp": {"name": "mtp", "path": "zoo/python-mtp", "draft_vocab": 1024, "quantize": "int8"},
    "eagle3": {"name": "eagle", "path": "zoo/python-eagle3", "quantize": "int8", **INT8_EAGLE3_TREE},
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "args": {"type": "array",
          "items": {"type": "string"}}, "doc": {"type": "string"}}, "required": ["name", "args", "doc"]}
GRAMMARS = {
    "json-object": {"json_object": True},
    "json-schema": {"json": SCHEMA, "disable_any_whitespace": True},
    "no-strings": {"regex": "[^'\"#\\x00]{0,400}"},  # code without string literals or comments
}
REPEATS, NEW = 1, 64


def main() -> None:
    base = draftsman.load({"target": {"path": "zoo/python-target"}})
    modes = {"none": [True], **{name: [True, False] for name in DRAFTERS if name != "none"}}
    contenders = []
    for name, cfg in DRAFTERS.items():
        decoder = base.with_drafter(cfg)
        for within in modes[name]:  # each call sets its own mode: the two share the decoder
            mode = partial(setattr, decoder.engine, "draft_within_grammar", within)
            contenders.append(((name, within), decoder, mode))
    runs = {(grammar, *label): run for (grammar, label), run in
            interleaved_runs(base, continuation_prompts(), GRAMMARS, contenders, REPEATS, NEW).items()}
    speed = {key: run["tokens"] / run["seconds"] for key, run in runs.items()}
    print("| grammar | drafter | drafts | tokens/s | vs plain, same grammar | tau | output = plain |")
    print("|---|---|---|---|---|---|---|")
    for grammar in GRAMMARS:
        plain = runs[(grammar, "none", True)]
        for name in DRAFTERS:
            for within in modes[name]:
                key = (grammar, name, within)
                run = runs[key]
                same = sum(a == b for a, b in zip(run["outputs"], plain["outputs"]))
                label = "-" if name == "none" else "within" if within else "free"
                print(f"| {grammar} | {name} | {label} | {speed[key]:.1f} | "
                      f"{speed[key] / speed[(grammar, 'none', True)]:.2f}x | {statistics.mean(run['tau']):.2f} | "
                      f"{same}/{len(plain['outputs'])} |")


if __name__ == "__main__":
    main()
