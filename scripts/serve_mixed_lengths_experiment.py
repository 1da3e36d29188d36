"""How long short requests wait when they are batched with long ones in `draftsman serve`
(draftsman/serve_batch.py; docs/serving.md).

One server with the bundled target and `ngram` is held busy while four requests queue: two short
(--short tokens) and two long (--long tokens), each with min_tokens = max_tokens so every row runs
its full length. Then it is freed, and each request's latency from that moment is printed,
--repeats times. To compare with an earlier version of the batcher, run the same script with
that version installed (pip install -e <its checkout> --no-deps).

    python scripts/serve_mixed_lengths_experiment.py [--short 16] [--long 160] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import draftsman
from draftsman.serve import Server

ZOO = Path(__file__).resolve().parent.parent / "zoo"
PROMPTS = ["import os\n", "def main():\n", "class Foo:\n", "for i in range("]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    lengths = [args.short, args.long, args.short, args.long]
    decoder = draftsman.load({"target": {"path": str(ZOO / "python-target")}, "drafter": {"name": "ngram"}})
    server = Server(decoder, "zoo", "127.0.0.1", 0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    finished: dict[int, float] = {}

    def send(i: int) -> None:
        body = json.dumps({"prompt": PROMPTS[i], "max_tokens": lengths[i], "min_tokens": lengths[i]}).encode()
        request = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            json.loads(r.read())
        finished[i] = time.perf_counter()

    short, long = [], []
    for repeat in range(args.repeats):
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        with server.generating:  # held busy: all four wait, in this order
            for i, thread in enumerate(threads):
                thread.start()
                while len(server.batcher.waiting) < i + 1:
                    time.sleep(0.005)
            start = time.perf_counter()
        for thread in threads:
            thread.join()
        waits = [finished[i] - start for i in range(len(PROMPTS))]
        short += waits[0::2]
        long += waits[1::2]
        rounded = [round(w, 2) for w in waits]
        print(f"repeat {repeat}: short {rounded[0::2]} s, long {rounded[1::2]} s")
    print(f"mean latency: short ({args.short} tokens) {statistics.mean(short):.2f} s, "
          f"long ({args.long} tokens) {statistics.mean(long):.2f} s")
    server.shutdown()


if __name__ == "__main__":
    main()
