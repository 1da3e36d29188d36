"""`draftsman datastore`: tokenize a `retrieval` datastore once, with the target's tokenizer, and
write it as an index the drafter loads in a moment (drafters/datastore_index.py).

    draftsman datastore my-docs/ --target my-target/ --out my-docs.safetensors
    # then: drafter: {name: retrieval, path: my-docs.safetensors}
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The index's suffix; drafters/datastore_index.py's SUFFIX (a test keeps them the same). That module,
# and what build() runs on, import torch: imported there, `draftsman datastore --help` answers at once.
SUFFIX = ".safetensors"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help='the text: a text file, a JSONL file of {"text": ...} lines, or a folder of such '
                                  "files (hidden files and files that are not UTF-8 text are skipped)")
    p.add_argument("--target", required=True, help="the target model folder: its tokenizer makes the token ids")
    p.add_argument("--out", required=True, help=f"the index file to write (ends in {SUFFIX})")
    p.add_argument("--min-ngram", type=int, default=2, help="shortest n-gram size indexed (the drafter's min_ngram "
                                                            "must be at least this)")
    p.add_argument("--max-ngram", type=int, default=4, help="longest n-gram size indexed (the drafter's max_ngram "
                                                            "must be at most this)")


def build(source: str, target: str, out: str, min_ngram: int = 2, max_ngram: int = 4) -> dict:
    from .drafters.datastore import Datastore, read_documents
    from .drafters.datastore_index import check_replaceable, is_index, save_index
    from .models import check_model_folder, load_tokenizer

    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= --min-ngram <= --max-ngram (got {min_ngram}, {max_ngram})")
    if not is_index(out):
        raise ValueError(f"--out '{out}' must end in {SUFFIX}: the retrieval drafter tells an index from a text "
                         f"datastore by that suffix (try --out {Path(out).with_suffix(SUFFIX)})")
    check_replaceable(out)
    folder = check_model_folder(target, "--target")
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"--target '{target}' has no tokenizer files (tokenizer.json / tokenizer_config.json): the "
                         "datastore's token ids must be the target's; give the folder its tokenizer")
    t0 = time.perf_counter()
    texts = read_documents(source)
    datastore = Datastore.from_texts(texts, tokenizer, range(min_ngram, max_ngram + 1))
    save_index(out, datastore, tokenizer, documents=len(texts), source=str(source))
    return {"documents": len(texts), "tokens": len(datastore), "seconds": round(time.perf_counter() - t0, 1),
            "megabytes": round(Path(out).stat().st_size / 2**20, 1)}


def run(args: argparse.Namespace) -> int:
    report = build(args.source, args.target, args.out, args.min_ngram, args.max_ngram)
    print(f"wrote {args.out}: {report['documents']} documents, {report['tokens']} tokens, n-gram sizes "
          f"{args.min_ngram}..{args.max_ngram}, {report['megabytes']} MB in {report['seconds']} s", file=sys.stderr)
    print(f"use it with: drafter: {{name: retrieval, path: {args.out}}}", file=sys.stderr)
    return 0
