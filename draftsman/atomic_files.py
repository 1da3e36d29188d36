"""Files written whole or not at all: checkpoints, heads, a drafter's memory, a datastore index."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def replaced_whole(path: str | Path, tmp_name: str | None = None, mode: int | None = None):
    """Yields a temporary path beside `path` to write; when the block ends it replaces `path` in one
    rename, so a kill mid-write leaves the previous file intact. If the block raises (a full disk,
    Ctrl-C) the partial file is removed: a multi-GB checkpoint's half stays nowhere. (A SIGKILL's
    is overwritten by the next write.) tmp_name: the temporary file's name (default path + .tmp);
    mode: its permissions before the rename (tempfiles and umasks differ; shared files want 0o644)."""
    path = Path(path)
    tmp = path.with_name(tmp_name or path.name + ".tmp")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
