"""The bundled demo pair: zoo/python-target and zoo/python-draft (built by `make zoo`), and the
heads trained for the target (zoo/python-medusa, python-eagle, python-eagle3, python-mtp,
python-mlp-speculator; `zoo/train_heads.sh`).

Both are small Llamas pretrained on the Python stdlib (see zoo/README.md); held-out stdlib files
(same deterministic split as training) give benchmark prompts the models never saw.
"""
from __future__ import annotations

from pathlib import Path

_HINT = "run `make zoo` (python -m draftsman.training.pretrain --config training/configs/pretrain.yaml)"


def zoo_dir() -> Path:
    """<repo>/zoo: this file is <repo>/draftsman/zoo.py (editable install)."""
    d = Path(__file__).resolve().parent.parent / "zoo"
    if not d.is_dir():
        raise FileNotFoundError(f"zoo folder {d} is missing; {_HINT}")
    return d


def _model(name: str) -> Path:
    p = zoo_dir() / name
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is missing or incomplete; {_HINT}")
    return p


def target_path() -> Path:
    return _model("python-target")


def draft_path() -> Path:
    return _model("python-draft")


def heads_path(folder: str) -> Path | None:
    """A bundled heads folder (python-medusa, python-eagle, python-eagle3, python-mtp, python-mlp-speculator) or the
    parallel draft model (python-pard) if it exists, else None: optional extras of the demo pair
    (`zoo/train_heads.sh` trains them)."""
    p = zoo_dir() / folder
    return p if (p / "config.json").is_file() and (p / "model.safetensors").is_file() else None


def heldout_files() -> list[Path]:
    """Held-out stdlib files of the running interpreter (never trained on), sorted."""
    from draftsman.training.corpus import split_files

    return split_files()[1]
