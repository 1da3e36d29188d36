"""A `retrieval` datastore written once to a file (`draftsman datastore`), so a drafter loads it in
a moment instead of reading and tokenizing its text at every start (REST, too, builds its index
ahead of time). One safetensors file: the tokens and, for each n-gram size, the sorted hash table.

The file records which tokenizer made its ids. Looked up with another tokenizer's ids, a datastore
would find nothing, or the wrong text, without any error, so a mismatch is refused at load.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic_files import replaced_whole
from ..models import tokenizer_fingerprint
from .datastore import BOUNDARY, Datastore

FORMAT = "draftsman-retrieval-datastore"
VERSION = "1"
SUFFIX = ".safetensors"
def is_index(path: str | Path) -> bool:
    return Path(path).suffix == SUFFIX


def check_replaceable(path: str | Path) -> None:
    """An index is written over an earlier index only, never over a file that shares its suffix (a
    model's model.safetensors); and to a file's path, not a folder's."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out '{path}' is a folder: give the index file's path, "
                         f"e.g. {path / ('datastore' + SUFFIX)}")
    if not path.exists():
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            written_here = (f.metadata() or {}).get("format") == FORMAT
    except Exception as e:  # not readable safetensors (safetensors raises its own error type)
        # A cut index (a full disk, a copy stopped half way) keeps its header: it is rebuilt in place. Anything
        # else that does not parse is nobody's weights but may be someone's file: named, and left to delete.
        if _header_format(path) == FORMAT:
            return
        raise ValueError(f"--out '{path}' exists and is not a datastore index: it is not readable safetensors "
                         f"({e}), so it is damaged or something else. Delete it if it is a damaged index, or give "
                         "another path") from None
    if not written_here:
        raise ValueError(f"--out '{path}' exists and is not a datastore index (model weights?): the index would "
                         "replace it. Give another path")


def _header_format(path: Path) -> str | None:
    """The `format` in a safetensors header that still parses, however much of the file after it is lost."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(min(size, 2**24)))  # a cut header fails to parse: None
        return header["__metadata__"]["format"]
    except (OSError, struct.error, ValueError, TypeError, KeyError):
        return None


def build_command(source: str, target: str, out: str, min_ngram: int = 2, max_ngram: int = 4) -> str:
    return (f"draftsman datastore {source} --target {target} --out {out} "
            f"--min-ngram {min_ngram} --max-ngram {max_ngram}")


def save_index(path: str | Path, datastore: Datastore, tokenizer, documents: int, source: str) -> None:
    """Written to a temporary file beside `path`, then moved over it: a kill leaves no half index."""
    path = Path(path)
    if datastore.tokens.numel() >= 2**31:
        raise ValueError(f"the datastore holds {datastore.tokens.numel()} tokens; an index stores positions as "
                         "int32, so it takes fewer than 2^31: split the text into several datastores")
    # int32 halves the file; hashes are below 2^31 and token ids far below.
    tensors = {"tokens": datastore.tokens.to(torch.int32)}
    for n, (keys, positions) in datastore.tables.items():
        tensors[f"keys.{n}"] = keys.to(torch.int32)
        tensors[f"positions.{n}"] = positions.to(torch.int32)
    metadata = {"format": FORMAT, "version": VERSION, "sizes": ",".join(str(n) for n in datastore.sizes),
                "tokenizer": tokenizer_fingerprint(tokenizer), "documents": str(documents), "source": source}
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_whole(path, mode=0o644) as tmp:  # an index is meant to be shared, as a heads folder is
        save_file(tensors, str(tmp), metadata=metadata)


def load_index(path: str | Path, tokenizer, sizes: range, target: str = "TARGET") -> tuple[Datastore, dict]:
    """The datastore in `path`, with the tables of `sizes` only, and the file's metadata. `target`
    names the target folder in the rebuild command an error suggests."""
    path = Path(path)
    elsewhere = build_command("TEXT", target, str(path.with_name("datastore" + SUFFIX)))
    if path.is_dir():  # (it said the index "does not exist", and its command's --out was refused)
        raise ValueError(f"retrieval: datastore index '{path}' is a folder: give an index file, built with "
                         f"`{elsewhere}`, or a folder of text without the {SUFFIX} suffix")
    if not path.is_file():
        raise FileNotFoundError(f"retrieval: datastore index '{path}' does not exist: build it with "
                                f"`{build_command('TEXT', target, str(path))}`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta, names = f.metadata() or {}, set(f.keys())
    except SafetensorError as e:  # cut short, or not safetensors at all
        raise ValueError(f"retrieval: datastore index '{path}' is damaged ({e}): delete it and rebuild it with "
                         f"`{build_command('TEXT', target, str(path))}`") from None
    if meta.get("format") != FORMAT:  # (model weights? building over them is refused: another path)
        raise ValueError(f"retrieval: '{path}' is a safetensors file but not a datastore index: build one "
                         f"at another path with `{elsewhere}`, or give the text itself")
    rebuild = build_command(meta.get("source", "TEXT"), target, str(path), sizes.start, sizes.stop - 1)
    if meta.get("version") != VERSION:
        raise ValueError(f"retrieval: datastore index '{path}' has format version {meta.get('version')}, this "
                         f"draftsman reads version {VERSION}: rebuild it with `{rebuild}`")
    try:
        stored = [int(n) for n in meta["sizes"].split(",")]
    except (KeyError, ValueError):
        raise ValueError(f"retrieval: datastore index '{path}' is damaged (its n-gram sizes read "
                         f"{meta.get('sizes')!r}): rebuild it with `{rebuild}`") from None
    if meta.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"retrieval: datastore index '{path}' was tokenized by another tokenizer than the "
                         "target's, so its token ids would not mean the target's text: rebuild it for this "
                         f"target with `{rebuild}`")
    missing = [n for n in sizes if n not in stored]
    if missing:
        raise ValueError(f"retrieval: datastore index '{path}' holds n-gram sizes {stored[0]}..{stored[-1]}, "
                         f"not {', '.join(map(str, missing))}: set min_ngram / max_ngram within "
                         f"{stored[0]}..{stored[-1]}, or rebuild it with `{rebuild}`")
    absent = sorted({"tokens", *(f"{kind}.{n}" for n in sizes for kind in ("keys", "positions"))} - names)
    if absent:
        damage = f"no tensor {', '.join(absent)}"
    else:
        try:
            with safe_open(str(path), framework="pt") as f:
                tokens = f.get_tensor("tokens")
                tables = {n: (f.get_tensor(f"keys.{n}"), f.get_tensor(f"positions.{n}")) for n in sizes}
            damage = index_damage(tokens, tables)
        except SafetensorError as e:
            damage = str(e)
    if damage:
        raise ValueError(f"retrieval: datastore index '{path}' is damaged ({damage}): rebuild it with `{rebuild}`")
    tables = {n: (keys.long(), positions.long()) for n, (keys, positions) in tables.items()}
    return Datastore(tokens.long(), sizes, tables), meta


def index_damage(tokens: torch.Tensor, tables: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """What makes tensors read from an index unusable (a cut or hand-edited file); None if nothing. Each
    check is one pass at most: a position past the tokens would crash a lookup mid-generation."""
    tensors = {"tokens": tokens, **{f"{kind}.{n}": t for n, pair in tables.items()
                                    for kind, t in zip(("keys", "positions"), pair)}}
    for name, t in tensors.items():
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return f"{name} is {t.dim()}-D {t.dtype}, not 1-D integers"
    if tokens.numel() and int(tokens.min()) < BOUNDARY:
        return f"token id {int(tokens.min())}"
    for n, (keys, positions) in tables.items():
        windows = max(tokens.numel() - n, 0)  # as Datastore builds them: each window has a token after it
        if keys.numel() != windows or positions.numel() != windows:
            return (f"keys.{n} and positions.{n} hold {keys.numel()} and {positions.numel()} entries, "
                    f"for {tokens.numel()} tokens")
        # (Unsorted keys are not looked for: they cost drafts, never a crash, and the pass costs a load.)
        if windows and not 0 <= int(positions.min()) <= int(positions.max()) < windows:
            return f"positions.{n} outside its {tokens.numel()} tokens"
    return None
