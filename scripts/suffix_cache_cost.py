"""What the `suffix` drafter's cache costs (docs/benchmarks.md): memory, time to cache a finished
row (with and without an eviction), time per propose against a full cache, and what the cache
adds to a full garbage collection. The rows are cut
from the bundled target's training corpus, tokenized with its tokenizer; no model runs.

    python scripts/suffix_cache_cost.py --requests 1000
"""
from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import torch
from transformers import AutoTokenizer

from draftsman.drafters import RoundFeedback
from draftsman.drafters.suffix import SuffixDrafter
from draftsman.drafters.suffix_index import SuffixIndex
from draftsman.training import corpus
from draftsman.verifier.sampling import SamplingParams

PROMPT, NEW = 56, 200  # tokens per row: a prompt, then what the target "wrote"


def finish_row(drafter: SuffixDrafter, tokens: list[int]) -> None:
    """One request through the drafter as the engine runs it: begin, its output emitted, it ends."""
    drafter.begin([tokens[:PROMPT]], SamplingParams(), torch.Generator())
    drafter.observe(RoundFeedback([[]], [tokens[PROMPT:]]))
    drafter.keep_rows([])


def full_collection_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="zoo/python-target")
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    train, _ = corpus.split_files()
    ids: list[int] = []
    for path in train:
        if len(ids) >= (2 * args.requests + 100) * (PROMPT + NEW):
            break
        text = corpus.read_text(path)
        if text:
            ids += tokenizer(text[:20000], verbose=False)["input_ids"]
    rows = [ids[i * (PROMPT + NEW):(i + 1) * (PROMPT + NEW)] for i in range(2 * args.requests)]
    contexts = [ids[-(300 * (i + 1)):-(300 * i) or None] for i in range(50)]  # 300-token rows, not cached

    collect_before = full_collection_ms()
    traced = SuffixDrafter(SuffixDrafter.Options(max_cached_requests=args.requests))
    tracemalloc.start()  # memory on one drafter, times on another: tracing slows Python down
    for tokens in rows[:args.requests]:
        finish_row(traced, tokens)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del traced
    drafter = SuffixDrafter(SuffixDrafter.Options(max_cached_requests=args.requests))
    t0 = time.perf_counter()
    for tokens in rows[:args.requests]:
        finish_row(drafter, tokens)
    filling = (time.perf_counter() - t0) / args.requests
    t0 = time.perf_counter()
    for tokens in rows[args.requests:]:  # each one evicts the oldest
        finish_row(drafter, tokens)
    evicting = (time.perf_counter() - t0) / args.requests
    drafter.begin(contexts[:1], SamplingParams(), torch.Generator())
    t0 = time.perf_counter()
    for context in contexts:
        drafter.own[0] = SuffixIndex(drafter.sizes)  # the row's own index is built in the propose, as a new row's
        drafter.propose([context])
    proposing = (time.perf_counter() - t0) / len(contexts)
    collect_after = full_collection_ms()
    cache = drafter.report()["cache"]
    print(f"{cache['requests']} cached rows, {cache['tokens']} tokens: {memory / 2**20:.0f} MiB; "
          f"{filling * 1e3:.2f} ms to cache a finished row, {evicting * 1e3:.2f} ms with an eviction; "
          f"{proposing * 1e3:.2f} ms per propose of a 300-token row")
    print(f"a full garbage collection: {collect_after:.0f} ms with the cache, {collect_before:.0f} ms before it")
    for batch in (1, 16, 64):  # the running rows' index: each row reads the others' outputs
        rows_now = [ids[-(300 * (i + 1)):-(300 * i) or None] for i in range(batch)]
        drafter.begin([r[:56] for r in rows_now], SamplingParams(), torch.Generator())
        drafter.observe(RoundFeedback([[] for _ in rows_now], [r[56:] for r in rows_now]))
        drafter.propose(rows_now)  # builds each row's own index
        t0 = time.perf_counter()
        for _ in range(5):
            drafter.propose(rows_now)
        per_row = (time.perf_counter() - t0) / (5 * batch)
        print(f"batch {batch}, 300-token rows running: {per_row * 1e3:.2f} ms per row per propose")
    print({k: v for k, v in drafter.report().items() if k != "cache"})


if __name__ == "__main__":
    main()
