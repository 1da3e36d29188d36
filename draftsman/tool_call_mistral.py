"""Mistral's tool calls (`--tool-call-parser mistral`, vLLM's name): the reply's content, then
[TOOL_CALLS] and the calls, in the form of the tokenizer's version:

    Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]   (before v11)
    Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11 on)

(some v11 models write no [ARGS]: `get_weather{"city": "Paris"}`; v13's [CALL_ID] and the id
after it are read past). [TOOL_CALLS], [ARGS] and [CALL_ID] are special tokens, which decoded
text drops, so under this parser the target's decoded text keeps them (Decoder.keep_in_text,
MARKERS). Mistral's chat templates refuse a call id that is not 9 letters and digits, so the
calls get such ids, as vLLM gives them.
"""
from __future__ import annotations

import json
import random
import re
import string

CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (CALLS, ARGS, CALL_ID)
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def mistral_call(name: str, arguments) -> dict:
    """One call in OpenAI's shape, with the 9-character id Mistral's templates take back."""
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    call_id = "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def mistral_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(the content before [TOOL_CALLS], None when empty; the calls after it), or None when the
    reply holds no [TOOL_CALLS] or what follows it is not calls (it is then all content)."""
    if CALLS not in text:
        return None
    content, rest = text.split(CALLS, 1)
    calls = []
    for part in rest.split(CALLS):
        part_calls = _json_list_calls(part) if part.lstrip().startswith("[") else _named_call(part)
        if not part_calls:
            return None
        calls += part_calls
    return content.strip() or None, calls


def _json_list_calls(part: str) -> list[dict]:
    """Before v11: a JSON list of {"name", "arguments"}."""
    try:
        value = json.loads(part)
    except json.JSONDecodeError:
        return []
    if not isinstance(value, list):
        return []
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or \
                not isinstance(item.get("arguments", {}), (dict, str)):
            return []
        calls.append(mistral_call(item["name"], item.get("arguments", {})))
    return calls


def _named_call(part: str) -> list[dict]:
    """v11 on: NAME[ARGS]{json}, NAME[CALL_ID]ID[ARGS]{json}, or NAME{json}."""
    if ARGS in part:
        name, arguments = part.split(ARGS, 1)
    else:
        brace = part.find("{")
        if brace < 0:
            return []
        name, arguments = part[:brace], part[brace:]
    name = name.split(CALL_ID, 1)[0].strip()
    try:
        value, end = json.JSONDecoder().raw_decode(arguments.strip())
    except json.JSONDecodeError:
        return []
    if not NAME.fullmatch(name) or not isinstance(value, dict) or arguments.strip()[end:].strip():
        return []
    return [mistral_call(name, value)]


class MistralCallStream:
    """A streamed reply: content as it comes until [TOOL_CALLS] (text that may be its start held
    until the next piece tells); from there the reply is held to its end and sent as its calls,
    or as content when it is not calls."""

    def __init__(self):
        self.held = ""
        self.in_calls = False
        self.calls = 0

    def feed(self, piece: str) -> list[dict]:
        from .tool_calls import _content, tag_start_at_end

        self.held += piece
        if self.in_calls:
            return []
        if CALLS in self.held:
            before, after = self.held.split(CALLS, 1)
            self.held, self.in_calls = CALLS + after, True
            return _content(before)
        keep = tag_start_at_end(self.held, CALLS)
        sent, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return _content(sent)

    def finish(self) -> list[dict]:
        from .tool_calls import _content

        held, self.held = self.held, ""
        parsed = mistral_calls(held) if self.in_calls else None
        if parsed is None:
            return _content(held)
        content, calls = parsed  # (content is empty here: what came before was sent)
        self.calls = len(calls)
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
