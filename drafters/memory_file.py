"""A drafter's memory of earlier requests kept across restarts: the `suffix` drafter's cache of
outputs, the `recycling` drafter's candidate matrix. Both start empty in a new process and take
a while of serving to fill; with `memory_file` set a drafter loads its memory at start and
writes it back when asked (Decoder.save_drafter_memory(); the CLI's generate, chat and serve do
when they end).

One safetensors file, written to a temporary file beside it and moved over it (a kill never
leaves half a memory). Its metadata says which drafter wrote it and for what: token ids drafted
for another tokenizer, or candidates ranked by another target, would give no errors, only drafts
that are never accepted, so a memory written for something else is refused at load, the file left
as it is. A drafter takes `memory_file` by mixing in KeepsMemory (below) and saying what it
saves, what it restores and what its memory is valid for.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic_files import replaced_whole

FORMAT = "draftsman-drafter-memory"
VERSION = "1"


def write_memory(path: str | Path, drafter: str, identity: dict, tensors: dict[str, torch.Tensor]) -> str:
    """Atomically (tmp + rename); returns the path written. identity: what the memory is valid
    for (a target's or tokenizer's fingerprint), checked by the drafter at load."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)  # a folder it cannot make: the OSError names it
    metadata = {"format": FORMAT, "version": VERSION, "drafter": drafter, "identity": json.dumps(identity)}
    try:
        # per_writer: a generate and a serve sharing one memory file may save at once
        with replaced_whole(path, per_writer=True) as tmp:  # interrupted (Ctrl-C): no half file beside the memory
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    except OSError as e:  # the advice follows the cause: a full disk is one of several
        fix = ("free some space, or point memory_file at another disk" if e.errno in (errno.ENOSPC, errno.EDQUOT)
               else "point memory_file at a writable path" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
               else "save again, or point memory_file at another path")
        raise OSError(f"{drafter}: memory_file '{path}' could not be written ({e}); the last saved memory "
                      f"stands: {fix}") from e
    return str(path)


def read_memory(path: str | Path, drafter: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(identity, tensors) of a memory `drafter` wrote; None where the file does not exist yet
    (a first start: the drafter starts empty and the file is written on the first save)."""
    path = Path(path).expanduser()
    if not path.exists():
        return None
    fix = f"point {drafter}'s memory_file at a new path (it starts empty) or delete '{path}'"
    if not path.is_file():
        raise ValueError(f"{drafter}: memory_file '{path}' is a directory, not a file: {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()} if meta.get("format") == FORMAT else {}
    except (SafetensorError, ValueError) as e:
        raise ValueError(f"{drafter}: memory_file '{path}' is not a drafter memory ({e}): {fix}") from None
    except OSError as e:  # unreadable (permissions): the file may be fine, so it is not called a wrong one
        raise OSError(f"{drafter}: memory_file '{path}' could not be read ({e})") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{drafter}: memory_file '{path}' is a safetensors file but not a drafter memory: {fix}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{drafter}: memory_file '{path}' has format version {meta.get('version')}, this "
                         f"draftsman reads version {VERSION}: {fix}")
    if meta.get("drafter") != drafter:
        raise ValueError(f"{drafter}: memory_file '{path}' holds a '{meta.get('drafter')}' drafter's memory, "
                         f"not a '{drafter}' one: {fix}")
    return json.loads(meta.get("identity") or "{}"), tensors  # none recorded: it fits nothing


def refuse(path: str | Path, drafter: str, written_for: str, why: str) -> ValueError:
    """The error for a memory written for another target or tokenizer."""
    return ValueError(f"{drafter}: memory_file '{Path(path).expanduser()}' was written for another {written_for}: "
                      f"{why}. Its drafts would never be accepted here: point memory_file at a new path (it "
                      "starts empty) or delete the file, or point target.path at the target it was written for.")


class KeepsMemory:
    """For a drafter with a `memory_file` option: memory_files(), save_memory() and loading at
    start, around three methods of its own (what it saves, what it restores, and whether a
    file's identity fits) and `memory_identity`, set before load_memory()."""

    memory_identity: dict
    memory_written_for = "target"  # what a refused memory was written for, in the error

    def memory_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def restore_memory(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def memory_mismatch(self, identity: dict) -> str | None:
        """Why a memory recorded for `identity` does not fit this drafter's target; None if it does."""
        raise NotImplementedError

    def memory_damage(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """What is wrong with a file's tensors (missing, misshapen, ids outside the vocabulary,
        probabilities that are not probabilities: a corrupted or hand-made file); None if nothing.
        Checked before restore_memory: a NaN q would break the verifier's exactness, and an id
        outside the vocabulary would crash the target pass."""
        raise NotImplementedError

    def memory_files(self) -> list[str]:
        return [self.options.memory_file] if self.options.memory_file else []

    def save_memory(self) -> list[str]:
        if not self.options.memory_file:
            return []
        return [write_memory(self.options.memory_file, self.name, self.memory_identity, self.memory_tensors())]

    def load_memory(self) -> None:
        """The memory_file's memory, if the file exists; refused if it does not fit."""
        memory = read_memory(self.options.memory_file, self.name)
        if memory is None:
            return
        identity, tensors = memory
        why = self.memory_mismatch(identity)
        if why:
            raise refuse(self.options.memory_file, self.name, self.memory_written_for, why)
        damage = self.memory_damage(tensors)
        if damage:
            path = Path(self.options.memory_file).expanduser()
            raise ValueError(f"{self.name}: memory_file '{path}' is damaged: it holds {damage}. Delete it, or point "
                             "memory_file at a new path (it starts empty)")
        self.restore_memory(tensors)


def within(ids: torch.Tensor, low: int, vocab_size: int) -> bool:
    """Every id in [low, vocab_size) (True for none)."""
    return not ids.numel() or (int(ids.min()) >= low and int(ids.max()) < vocab_size)


def integers(*tensors: torch.Tensor) -> bool:
    """Every tensor holds integers (ids, lengths): a float id would index nothing or draft nothing."""
    return all(not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) for t in tensors)
