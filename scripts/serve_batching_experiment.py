"""What batching waiting requests buys `draftsman serve` on the bundled target
(draftsman/serve_batch.py; docs/serving.md).

For each drafter, one server answers `--clients` requests sent at the same moment (one prompt each,
greedy, a fixed number of new tokens), with `--max-batch-rows 1` (one request at a time) and with
batching, alternating, `--repeats` times. Printed: the wall time until the last answer, the
tokens per second of all clients together, the mean wait per request, and batched over one at a
time. Greedy answers must be equal in both modes (the script stops if not).

    python scripts/serve_batching_experiment.py [--clients 8] [--max-new-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from transformers.utils import logging as hf_logging

import draftsman
from draftsman.bench.config import BUNDLED_PROMPTS
from draftsman.bench.prompts_set import by_category, read_prompts
from draftsman.serve import Server

ZOO = Path(__file__).resolve().parent.parent / "zoo"
DRAFTERS = {
    "none": {"name": "none"},
    "ngram": {"name": "ngram"},
    "ngram-adaptive": {"name": "ngram", "adaptive": True},
    "eagle3": {"name": "eagle", "path": str(ZOO / "python-eagle3"), "quantize": "int8", "depth": 6,
               "total_tokens": 20, "sampled_depth": 5, "min_confidence": 0.05},
    "eagle3-adaptive": {"name": "eagle", "path": str(ZOO / "python-eagle3"), "quantize": "int8", "depth": 6,
                        "total_tokens": 20, "sampled_depth": 5, "min_confidence": 0.05, "adaptive": True},
}


def burst(url: str, prompts: list[str], max_new_tokens: int) -> tuple[float, list[float], list[str]]:
    """All prompts sent at once, one request each: (wall seconds, each request's seconds, texts)."""
    start = threading.Barrier(len(prompts) + 1)
    waits, texts = [0.0] * len(prompts), [""] * len(prompts)

    def client(i: int) -> None:
        body = json.dumps({"prompt": prompts[i], "max_tokens": max_new_tokens, "min_tokens": max_new_tokens,
                           "temperature": 0}).encode()
        start.wait()
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=600) as r:
            texts[i] = json.loads(r.read())["choices"][0]["text"]
        waits[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, waits, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-rows", type=int, default=16)
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    groups = by_category(read_prompts(BUNDLED_PROMPTS)[0], per_category=args.clients).values()
    prompts = [p.text for batch in zip(*groups) for p in batch][: args.clients]  # the categories in turn
    print(f"{len(prompts)} clients at once, {args.max_new_tokens} new tokens each, greedy, "
          f"{args.repeats} alternating repeats; medians")
    print("| drafter | one at a time: wall s / tokens/s / mean wait s | batched (<= "
          f"{args.max_batch_rows} rows): wall s / tokens/s / mean wait s | batched vs one at a time |")
    print("|---|---|---|---|")
    for name in args.drafters.split(","):
        decoder = draftsman.load({"target": {"path": str(ZOO / "python-target")}, "drafter": DRAFTERS[name]})
        server = Server(decoder, "target", "127.0.0.1", 0, quiet=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
        burst(url, prompts[:2], 8)  # warm-up
        results: dict[int, list] = {1: [], args.max_batch_rows: []}
        answers: dict[int, list[str]] = {}
        for repeat in range(args.repeats):
            order = [1, args.max_batch_rows] if repeat % 2 == 0 else [args.max_batch_rows, 1]
            for limit in order:
                server.batcher.max_rows = limit
                wall, waits, texts = burst(url, prompts, args.max_new_tokens)
                results[limit].append((wall, statistics.mean(waits)))
                if answers.setdefault(limit, texts) != texts or answers.get(1, texts) != texts:
                    raise SystemExit(f"{name}: greedy answers differ between runs: batching changed an output")
        server.shutdown()
        server.server_close()
        tokens = len(prompts) * args.max_new_tokens
        cells = []
        for limit in (1, args.max_batch_rows):
            wall = statistics.median(w for w, _ in results[limit])
            wait = statistics.median(m for _, m in results[limit])
            cells.append((wall, wait))
        (wall1, wait1), (wall_b, wait_b) = cells
        print(f"| {name} | {wall1:.1f} / {tokens / wall1:.0f} / {wait1:.1f} | {wall_b:.1f} / {tokens / wall_b:.0f} / "
              f"{wait_b:.1f} | {wall1 / wall_b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
