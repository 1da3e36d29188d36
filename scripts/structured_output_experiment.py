"""Side by side in one process: plain decoding, `ngram` and EAGLE-3 on the bundled target, with no
grammar and under two grammars the target's Python output already satisfies (so the output, and
so tau, is the same as without: what changes is the cost of masking every tree node), interleaved
prompt by prompt, 2 repeats: 6 held-out continuation prompts, 96 new tokens, T=0, batch 1.
Prints tokens/s, the speedup over plain decoding under the same grammar and over the same drafter
without one, tau, and how many outputs equal plain decoding's under the same grammar.

    python scripts/structured_output_experiment.py
"""
import json
import statistics
import time

import draftsman
from draftsman.bench.config import INT8_EAGLE3_TREE

DRAFTERS = {
    "none": {"name": "none"},
    "ngram": {"name": "ngram"},
    "eagle3": {"name": "eagle", "path": "zoo/python-eagle3", "quantize": "auto", "dtype": "auto", **INT8_EAGLE3_TREE},
}
GRAMMARS = {
    "free": None,
    "regex-any": {"regex": r"[^\x00]{0,400}"},  # every token but NUL: the mask's cost alone
    "lark-lines": {"grammar": "start: LINE+\nLINE: /[ -~]*\\n/"},  # printable ASCII lines
}
REPEATS, NEW = 2, 96


def continuation_prompts(n: int = 6) -> list[str]:
    """The first n held-out continuation prompts of the bundled set."""
    records = [json.loads(line) for line in open("draftsman/bench/data/prompts.jsonl")][1:]
    return [r["text"] for r in records if r.get("category") == "continuation"][:n]


def interleaved_runs(base, prompts: list[str], grammars: dict, contenders: list, repeats: int, new: int) -> dict:
    """{(grammar, label): {tokens, seconds, tau, outputs}}: every contender under every grammar,
    interleaved prompt by prompt, `repeats` passes. contenders: (label, decoder, before), before()
    called before each of the contender's calls (None: nothing)."""
    runs: dict = {}
    for _ in range(repeats):
        for prompt in prompts:
            ids = base.encode([prompt])
            for grammar, spec in grammars.items():
                for label, decoder, before in contenders:
                    if before is not None:
                        before()
                    start = time.perf_counter()
                    out = decoder.generate(input_ids=ids, max_new_tokens=new, structured_output=spec)
                    run = runs.setdefault((grammar, label), {"tokens": 0, "seconds": 0.0, "tau": [], "outputs": []})
                    run["seconds"] += time.perf_counter() - start
                    run["tokens"] += len(out.token_ids[0])
                    run["tau"].append(out.stats.tau)
                    run["outputs"].append(out.token_ids[0])
    return runs


def main() -> None:
    base = draftsman.load({"target": {"path": "zoo/python-target"}})
    contenders = [(name, base.with_drafter(cfg), None) for name, cfg in DRAFTERS.items()]
    runs = interleaved_runs(base, continuation_prompts(), GRAMMARS, contenders, REPEATS, NEW)
    speed = {key: run["tokens"] / run["seconds"] for key, run in runs.items()}
    print("| grammar | drafter | tokens/s | vs plain, same grammar | vs no grammar | tau | output = plain |")
    print("|---|---|---|---|---|---|---|")
    for grammar in GRAMMARS:
        plain = runs[(grammar, "none")]["outputs"]
        for name in DRAFTERS:
            run = runs[(grammar, name)]
            same = sum(a == b for a, b in zip(run["outputs"], plain))
            print(f"| {grammar} | {name} | {speed[(grammar, name)]:.1f} | "
                  f"{speed[(grammar, name)] / speed[(grammar, 'none')]:.2f}x | "
                  f"{speed[(grammar, name)] / speed[('free', name)]:.2f}x | {statistics.mean(run['tau']):.2f} | "
                  f"{same}/{len(plain)} |")


if __name__ == "__main__":
    main()
