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
    when no stop string completed. include: the row's text keeps the stop string that ended it
    (vLLM's include_stop_str_in_output); the tokens are the same either way."""

    def __init__(self, decode: Callable[[list[int]], str], strings: list[str], include: bool = False):
        self.decode = decode
        self.strings = strings
        self.include = include
        self.longest = max(map(len, strings))

    def __call__(self, before: list[int], new: list[int]) -> int | None:
        # Earlier rounds found no stop in `before`, so a stop must end in the new text. Decode only
        # a window of `before` wide enough to hold a stop's start (decoding the whole row every
        # round made the check O(length) per round: 0.73 ms at 2000 tokens with the bundled
        # tokenizer, against 0.015 ms for the window); its first characters may decode differently
        # from the full text (a split UTF-8 character, a dropped leading space), so the window
        # keeps a margin and matches are searched only near its end.
        window, window_chars = self._window(before)
        start = max(0, window_chars - self.longest - self.MARGIN // 2)  # where a new stop may start
        if self.first_stop(self.decode(window + new), start) is None:
            return None
        # The shortest prefix of the round that spells a stop string: plain decoding's stop.
        for keep in range(1, len(new) + 1):
            if self.first_stop(self.decode(window + new[:keep]), start) is not None:
                return keep
        return len(new)  # unreachable: the whole round spelt one

    MARGIN = 8  # characters a window holds beyond the longest stop string (its first may decode differently)

    def _window(self, before: list[int]) -> tuple[list[int], int]:
        """The last tokens of `before` that decode to at least longest + MARGIN characters (all
        of it when shorter), and how many characters they decode to: tokens can be empty (skipped
        special tokens) or part of a character."""
        need = self.longest + self.MARGIN
        n = need  # every token is at least a character in most tokenizers; widen when not
        while True:
            window = before[-n:] if n < len(before) else before
            chars = len(self.decode(window))
            if chars >= need or len(window) == len(before):
                return window, chars
            n *= 2

    def first_stop(self, text: str, start: int = 0) -> int | None:
        """Where the first stop string in `text` (at or after `start`) begins, or None."""
        found = [i for i in (text.find(s, start) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def text_end(self, text: str, start: int = 0) -> int | None:
        """Where a row's text ends when it holds a stop string (at or after `start`): before the
        first, or with `include` after the one that completed first; None when it holds none."""
        if not self.include:
            return self.first_stop(text, start)
        ends = [i + len(s) for s in self.strings if (i := text.find(s, start)) >= 0]
        return min(ends) if ends else None

    def cut(self, text: str) -> str:
        """The text before the first stop string, or through it with `include` (all of it when
        there is none)."""
        at = self.text_end(text)
        return text if at is None else text[:at]

    @property
    def hold_back(self) -> int:
        """Characters a stream must hold back: the start of a stop string that may yet complete."""
        return max(map(len, self.strings), default=1) - 1
