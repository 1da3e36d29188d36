"""Files written whole or not at all: checkpoints, heads, a drafter's memory, a datastore index."""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def replaced_whole(path: str | Path, tmp_name: str | None = None, mode: int | None = None, per_writer: bool = False):
    """Yields a temporary path beside `path` to write; when the block ends it replaces `path` in one
    rename, so a kill mid-write leaves the previous file intact. If the block raises (a full disk,
    Ctrl-C) the partial file is removed: a multi-GB checkpoint's half stays nowhere. (A SIGKILL's
    is overwritten by the next write.) tmp_name: the temporary file's name (default path + .tmp);
    per_writer: a name of the writer's own (pid and a random part) for a file that two processes
    may save at once, as a drafter's memory file: with one shared name one renamed the other's
    temporary away. (A SIGKILL's then stays, which is why checkpoints keep the shared name.)
    mode: its permissions before the rename (tempfiles and umasks differ; shared files want 0o644)."""
    path = Path(path)
    own = f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp" if per_writer else None
    tmp = path.with_name(tmp_name or own or path.name + ".tmp")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replaced_together(paths: list[str | Path], mode: int | None = None):
    """replaced_whole for files that must match (a config and its weights): yields one temporary
    path per file; the renames come only after every file is written, in the order given, so an
    interrupted write leaves all of them as they were. Only a kill between two renames (microseconds)
    can leave a mix: give such files a shared save id to tell."""
    with contextlib.ExitStack() as stack:
        # exits run last-entered first: enter in reverse so the renames go in the order given
        tmps = [stack.enter_context(replaced_whole(p, mode=mode)) for p in reversed(paths)]
        yield tmps[::-1]
