"""Mistral's tool calls (`--tool-call-parser mistral`, vLLM's name): the reply's content, then
[TOOL_CALLS] and the calls, in the form of the tokenizer's version:

    Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]   (before v11)
    Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11 on)

(some v11 models write no [ARGS]: `get_weather{"city": "Paris"}`; v13's [CALL_ID] and the id
after it are read past). [TOOL_CALLS], [ARGS] and [CALL_ID] are special tokens, which decoded
text drops, so the replies read under this parser keep them in their decoded text (generate's
keep_in_text, MARKERS). Mistral's chat templates refuse a call id that is not 9 letters and digits, so the
calls get such ids (mistral_call_id), as vLLM gives them. This module reads the calls' parts;
draftsman/tool_calls.py shapes them as OpenAI's and streams them.
"""
from __future__ import annotations

import json
import random
import re
import string

CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (CALLS, ARGS, CALL_ID)
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def mistral_call_id() -> str:
    """A call id Mistral's templates take back: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def mistral_call_parts(text: str) -> tuple[str | None, list[tuple[str, object]]] | None:
    """(the content before [TOOL_CALLS] as written, None when only white space; each call's (name, arguments) after
    it), or None when the reply holds no [TOOL_CALLS] or what follows it is not calls (it is
    then all content)."""
    if CALLS not in text:
        return None
    content, rest = text.split(CALLS, 1)
    calls = []
    for part in rest.split(CALLS):
        part_calls = _json_list_calls(part) if part.lstrip().startswith("[") else _named_call(part)
        if not part_calls:
            return None
        calls += part_calls
    return (content if content.strip() else None), calls  # unstripped, as vLLM's: as it streams


def _json_list_calls(part: str) -> list[tuple[str, object]]:
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
        calls.append((item["name"], item.get("arguments", {})))
    return calls


def _named_call(part: str) -> list[tuple[str, object]]:
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
    return [(name, value)]
