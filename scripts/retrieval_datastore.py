"""Write the datastore of the `retrieval` experiment (docs/choosing-a-drafter.md): the training
split of the corpus the bundled target was trained on (the Python standard library, held-out files
left out, so no benchmark prompt can be looked up), one {"text": ...} line per file.

    python scripts/retrieval_datastore.py --out results/datastore/stdlib-train.jsonl
    draftsman compare --config configs/bench-retrieval-cpu.yaml
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsman.training import corpus as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/datastore/stdlib-train.jsonl")
    args = ap.parse_args()
    train, heldout = C.split_files()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w", encoding="utf-8") as f:
        for path in train:
            text = C.read_text(path)
            if text:
                f.write(json.dumps({"text": text}) + "\n")
                written += 1
    print(f"wrote {written} training files ({len(heldout)} held-out files left out) to {out}")


if __name__ == "__main__":
    main()
