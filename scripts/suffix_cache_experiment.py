"""The `suffix` drafter's cache of past outputs, measured side by side (docs/choosing-a-drafter.md).

One process, the bundled target, plain decoding, `ngram`, `suffix` without a cache and `suffix`
with one, interleaved prompt by prompt (this machine's noise hits them alike). Three passes over
the same held-out prompts, each drafter keeping its state from pass to pass:

  fresh      T=0, the cache starts empty: it holds only the earlier prompts' outputs
  repeated   T=0 again: every request was answered before (an agent loop, a retried call)
  resampled  T=1, new seeds: the same requests, different answers (best-of-n, self-consistency)
  overlap    T=0, the cache emptied first (Drafter.forget_outputs): each prompt again, and a
             second copy of it joins the running batch 8 rounds later (continuous batching, as
             a server does with a request sent twice): what the running rows share

    python scripts/suffix_cache_experiment.py --prompts 8 --max-new-tokens 64 --eagle3 zoo/python-eagle3

--eagle3 adds the bundled EAGLE-3 head (the zoo config's settings) and a cascade of `suffix` with
min_match 8 (silent until a long match) then that head.
"""
from __future__ import annotations

import argparse
import json
import time

import draftsman
from draftsman.prompts import heldout_prompts

PASSES = (("fresh", 0.0), ("repeated", 0.0), ("resampled", 1.0), ("overlap", 0.0))
JOIN_AFTER = 8  # rounds before the second copy joins, in the overlap pass


def drafters(extra: list[str], eagle3: str | None) -> dict[str, dict]:
    out = {"none": {"name": "none"}, "ngram": {"name": "ngram"},
           "suffix (no cache)": {"name": "suffix", "max_cached_requests": 0}, "suffix": {"name": "suffix"}}
    if eagle3:  # configs/bench-zoo-cpu.yaml's eagle3
        head = {"name": "eagle", "path": eagle3, "quantize": "int8", "depth": 6, "total_tokens": 20,
                "sampled_depth": 5, "min_confidence": 0.05}
        out["eagle3"] = head
        out["suffix (min_match 8), then eagle3"] = {"name": "cascade",
                                                    "drafters": [{"name": "suffix", "min_match": 8}, head]}
    for item in extra:  # label=JSON config, e.g. 'suffix f2={"name": "suffix", "max_spec_factor": 2}'
        label, config = item.split("=", 1)
        out[label] = json.loads(config)
    return out


def run(decoder, prompt: list[int], max_new_tokens: int, temperature: float, seed: int,
        overlap: bool) -> tuple[float, float, list[list[int]]]:
    """(seconds, tau, each row's tokens) of one request, or of a request and its copy joining."""
    if not overlap:
        t0 = time.perf_counter()
        out = decoder.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return time.perf_counter() - t0, out.stats.tau, out.token_ids
    decoder.drafter.forget_outputs()
    rounds, tokens, stats = [0], {}, draftsman.GenerationStats()

    def joining():
        rounds[0] += 1
        return [(prompt, max_new_tokens)] if rounds[0] == JOIN_AFTER else []

    t0 = time.perf_counter()
    for row, chunk in decoder.stream_batch([prompt], stats=stats, joining=joining, max_new_tokens=max_new_tokens,
                                           temperature=temperature, seed=seed):
        tokens.setdefault(row, []).extend(chunk.token_ids)
    return time.perf_counter() - t0, stats.tau, [tokens[r] for r in sorted(tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="zoo/python-target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafter", action="append", default=[], help="another drafter: LABEL=JSON config")
    ap.add_argument("--eagle3", help="an EAGLE-3 head's folder: add it, and a cascade of suffix then it")
    args = ap.parse_args()
    base = draftsman.load({"target": {"path": args.target}, "drafter": {"name": "none"}})
    decoders = {label: base if label == "none" else base.with_drafter(config)
                for label, config in drafters(args.drafter, args.eagle3).items()}
    ids = heldout_prompts(base.tokenizer, args.prompts)
    print(f"{args.prompts} held-out prompts, {args.max_new_tokens} new tokens, batch 1; speed over plain decoding "
          "(same pass, interleaved), tau in brackets")
    width = max(map(len, decoders)) + 2
    print(f"{'':{width}s}" + "".join(f"{name:>22s}" for name, _ in PASSES))
    results = {label: [] for label in decoders}
    for p_index, (name, temperature) in enumerate(PASSES):
        seconds = dict.fromkeys(decoders, 0.0)
        taus = {label: [] for label in decoders}
        outputs = {label: [] for label in decoders}
        for i, prompt in enumerate(ids):
            for label, decoder in decoders.items():
                took, tau, rows = run(decoder, prompt, args.max_new_tokens, temperature, 1000 * p_index + i,
                                      overlap=name == "overlap")
                seconds[label] += took
                taus[label].append(tau)
                outputs[label].append(rows)
        if temperature == 0.0:  # greedy: every drafter must give plain decoding's tokens
            assert all(outputs[label] == outputs["none"] for label in decoders), "outputs differ from plain decoding"
        for label in decoders:
            results[label].append((seconds["none"] / seconds[label], sum(taus[label]) / len(taus[label])))
    for label, cells in results.items():
        print(f"{label:{width}s}" + "".join(f"{f'{speed:.2f}x ({tau:.2f})':>22s}" for speed, tau in cells))
    print("greedy outputs equal plain decoding's in the T=0 passes")


if __name__ == "__main__":
    main()
