"""Tool calls in a chat reply, returned as OpenAI's API returns them (`message.tool_calls`, finish
reason "tool_calls"), for `draftsman serve --tool-call-parser hermes` (vLLM's flag and parser name).

The `hermes` format is the one Hermes 2 Pro, Qwen2.5 / Qwen3 and many tool-calling fine-tunes
emit, as their chat templates ask: each call a JSON object in its own block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the blocks is the reply's content. A block that is not such an object (bad JSON, no
name) stays in the content as the model wrote it: nothing is dropped. Parsing reads the output
only; it does not steer generation, so the output stays exactly the target's.
"""
from __future__ import annotations

import json
import uuid

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_call(name: str, arguments) -> dict:
    """One call in OpenAI's shape: arguments as a JSON string, a fresh id."""
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_of(block: str) -> dict | None:
    """The call a block's text holds, or None when it holds none."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return tool_call(value["name"], value.get("arguments", {}))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole reply -> (its content, None when only calls; its calls in order)."""
    content, calls, rest = [], [], text
    while OPEN in rest:
        before, after = rest.split(OPEN, 1)
        if CLOSE not in after:  # an unclosed block: the model stopped inside it
            break
        block, rest = after.split(CLOSE, 1)
        call = _call_of(block)
        content.append(before if call is not None else before + OPEN + block + CLOSE)
        if call is not None:
            calls.append(call)
    content.append(rest)
    if not calls:
        return text, []
    joined = "".join(content).strip()
    return joined or None, calls


class ToolCallStream:
    """A streamed reply's pieces -> OpenAI chat deltas: content as it comes, except text that may
    open a block (held until it does or cannot); each call whole, as its block closes."""

    def __init__(self):
        self.held = ""  # text not yet sent: a possible block opening, or a block's body
        self.inside = False
        self.calls = 0

    def feed(self, piece: str) -> list[dict]:
        self.held += piece
        deltas = []
        while True:
            if not self.inside:
                if OPEN in self.held:
                    before, self.held = self.held.split(OPEN, 1)
                    deltas += _content(before)
                    self.inside = True
                    continue
                keep = tag_start_at_end(self.held, OPEN)  # the end of the text may be the start of OPEN
                deltas += _content(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return deltas
            if CLOSE not in self.held:
                return deltas
            block, self.held = self.held.split(CLOSE, 1)
            self.inside = False
            call = _call_of(block)
            if call is None:
                deltas += _content(OPEN + block + CLOSE)
            else:
                deltas.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1

    def finish(self) -> list[dict]:
        """The text still held when the reply ends (an unclosed block is content)."""
        held, self.held = (OPEN if self.inside else "") + self.held, ""
        self.inside = False
        return _content(held)


def _content(text: str) -> list[dict]:
    return [{"content": text}] if text else []


def tag_start_at_end(text: str, tag: str) -> int:
    """How many characters at the end of `text` are the beginning of `tag` (held back in a
    stream until the next piece says whether the tag comes)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """The conversation with each earlier assistant tool call's arguments, which OpenAI clients
    send back as a JSON string, as the object chat templates expect (vLLM does the same); a
    string that is not JSON is left as it is."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_arguments_object(call) for call in calls]}
        out.append(message)
    return out


def _arguments_object(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
