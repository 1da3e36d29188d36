"""Write the prompt file of docs/serving.md's chunked-prefill measurement: 8 prompts, every
other one 800 tokens of Python source (this interpreter's argparse, json.decoder and
statistics) and the others a few tokens, so long prompts join batches of running streams.

    python scripts/long_prompts.py zoo/python-target /tmp/long_prompts.jsonl
    draftsman loadtest --url http://127.0.0.1:8000/v1 --prompts /tmp/long_prompts.jsonl \\
        --requests 32 --concurrency 4 --max-tokens 64 --fixed-length --stream
"""
import argparse
import inspect
import json
import json.decoder
import statistics
import sys

from transformers import AutoTokenizer

SHORT = ["def parse(text):\n", "import os\n", "class Stack:\n", "def fib(n):\n"]
LONG_TOKENS = 800


def main(target: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(target)
    sources = [tokenizer(inspect.getsource(m))["input_ids"] for m in (argparse, json.decoder, statistics)]
    with open(out, "w") as f:
        for i, short in enumerate(SHORT):
            ids = sources[i % len(sources)][500 * i: 500 * i + LONG_TOKENS]
            f.write(json.dumps({"id": f"long{i}", "text": tokenizer.decode(ids)}) + "\n")
            f.write(json.dumps({"id": f"short{i}", "text": short}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
