"""Stop strings: end a row when its generated text contains one of them.

A round emits several tokens at once, so a stop string can complete in the middle of a round: the
row keeps the tokens up to the one that completed it and drops the rest, exactly where plain
decoding would have stopped (the tokens before it are what they would have been anyway: stopping
changes no distribution). As in vLLM and the OpenAI API, the text ends before the stop string and
the token ids keep the tokens that spelt it. Only generated text is searched, never the prompt.
Strings, not token sequences: a tokenizer can spell the same text with different tokens.
"""
from __future__ import annotations

from typing import Callable


def check_stop_strings(stop, name: str = "stop") -> list[str]:
    """None or a list of non-empty strings -> the list (a lone string is refused: say [..])."""
    if stop is None:
        return []
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"{name} must be a list of strings, e.g. ['\\n\\n'], got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError(f"{name}: stop strings must not be empty (an empty string would stop every row at once)")
    return list(stop)


class StopStrings:
    """The engine's stop check for text stop strings. Called once per row and round with the row's
    tokens so far and the round's new tokens; returns how many of the new tokens to keep, or None
    when no stop string completed."""

    def __init__(self, decode: Callable[[list[int]], str], strings: list[str]):
        self.decode = decode
        self.strings = strings

    def __call__(self, before: list[int], new: list[int]) -> int | None:
        if self.first_stop(self.decode(before + new)) is None:
            return None
        # The shortest prefix of the round that spells a stop string: plain decoding's stop.
        for keep in range(1, len(new) + 1):
            if self.first_stop(self.decode(before + new[:keep])) is not None:
                return keep
        return len(new)  # unreachable: the whole round spelt one

    def first_stop(self, text: str) -> int | None:
        """Where the first stop string in `text` starts, or None."""
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def cut(self, text: str) -> str:
        """The text before the first stop string (all of it when there is none)."""
        at = self.first_stop(text)
        return text if at is None else text[:at]

    @property
    def hold_back(self) -> int:
        """Characters a stream must hold back: the start of a stop string that may yet complete."""
        return max(map(len, self.strings), default=1) - 1
