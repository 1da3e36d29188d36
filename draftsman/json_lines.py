"""JSON Lines text read a line at a time: prompt files, training data files, --messages .jsonl."""
from __future__ import annotations

import json
from collections.abc import Iterator


def json_lines(text: str, where: str, each: str) -> Iterator[tuple[int, str, object]]:
    """(line number, line, its JSON value) for each non-blank line. A line that is not JSON is
    named by `where` and its number, with `each`, what every line should hold."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{number}: not valid JSON ({e.msg}); {each}") from None
        yield number, line, value
