"""`draftsman export`'s flags and the engines each kind of heads exports to, apart from the
exporter (draftsman/export.py), which imports torch and transformers: `draftsman export --help`
and a mistyped flag answer without them."""
from __future__ import annotations

import argparse

ENGINES = {"eagle": ("vllm", "sglang"), "medusa": ("vllm", "medusa")}
# Heads `draftsman train` writes that are not exported: mtp (no engine layout can hold it) and
# mlp_speculator (already in its engine's layout). Accepted as kinds so that `draftsman export mtp`
# reaches export.export()'s explanation (why, and how to serve them), not argparse's "invalid choice".
NOT_EXPORTABLE = ("mtp", "mlp_speculator")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=sorted(ENGINES) + list(NOT_EXPORTABLE),
                   help="kind of heads to export (mtp and mlp_speculator heads are not exported: it says why and "
                        "how to serve them)")
    p.add_argument("--heads", required=True, help="heads folder written by draftsman train")
    p.add_argument("--target", required=True, help="the target model folder the heads were trained for")
    p.add_argument("--engine", required=True, help="vllm | sglang (eagle); vllm | medusa (medusa)")
    p.add_argument("--out", required=True, help="folder to write config.json + weights into")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
