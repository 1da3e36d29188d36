"""Where a draft model's window over a row starts once the row outgrows the draft model's context.

A draft model's context may be shorter than the target's (TinyLlama's 2048 positions under
Llama-2-7B's 4096; a small model of another family under `cross_tokenizer`). Past it, the draft
model reads the latest ids that leave room for a round's drafts, from position 0: its cache is
computed again over the window, so the window's first id serves as the start of a text (as in
StreamingLLM's sliding window with re-computation). The start moves a quarter of the room at a
time: a start moved by every new id would share no prefix with the draft cache, which would then
be fed its whole window again every round.
"""
from __future__ import annotations


def window_start(length: int, room: int) -> int:
    """The first id a draft model with `room` positions reads of a row of `length` ids: 0 while
    they fit, then the overflow rounded up to a quarter of the room, so the window keeps at
    least three quarters of the room and its start moves once per quarter of new ids."""
    if length <= room:
        return 0
    stride = max(1, room // 4)
    return -(-(length - room) // stride) * stride
