"""Corpus for the demo models: the Python standard library of the running interpreter.

The split is a pure function of each file's path relative to the stdlib root, so every
machine (and every later benchmark) agrees on which files are held out without storing a list.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

EOT = "<|endoftext|>"
HELDOUT_PERCENT = 5  # ~5% of files never trained on: validation loss + benchmark prompts


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return "%d.%d.%d" % sys.version_info[:3]


def is_heldout(rel_path: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Deterministic split: sha256 of the posix relative path, first 8 bytes mod 100."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h % 100 < percent


def list_files(root: Path | None = None) -> list[Path]:
    """All *.py under root (the stdlib by default), site-packages excluded, sorted for determinism."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune installed packages while walking (site-packages is most of the stdlib dir's size).
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted((p for p in out if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def split_files(root: Path | None = None, percent: int = HELDOUT_PERCENT) -> tuple[list[Path], list[Path]]:
    """(train, heldout) file lists; disjoint and covering list_files(root)."""
    root = Path(root) if root is not None else stdlib_root()
    train, held = [], []
    for p in list_files(root):
        (held if is_heldout(p.relative_to(root).as_posix(), percent) else train).append(p)
    return train, held


def files_digest(files: list[Path]) -> str:
    """A short hash of the files' paths, sizes and modification times: a token cache built from them
    is keyed by it, so another corpus with as many files, or an edited file, is tokenized again."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{Path(p).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def read_text(path: Path) -> str | None:
    """Source text exactly as on disk (newlines untouched); None if not UTF-8 (a few test fixtures)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_texts(files: list[Path]):
    for p in files:
        t = read_text(p)
        if t is not None and EOT not in t:
            yield t
