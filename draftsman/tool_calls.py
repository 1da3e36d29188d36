"""Tool calls in a chat reply, returned as OpenAI's API returns them (`message.tool_calls`, finish
reason "tool_calls"), for `draftsman serve --tool-call-parser hermes|qwen3_coder|llama3_json|pythonic`
(vLLM's flag and parser names; also `mistral`, draftsman/tool_call_mistral.py) and
`Decoder.chat(tool_call_parser=...)`.

- `hermes`, the format Hermes 2 Pro, Qwen2.5 / Qwen3 and many tool-calling fine-tunes emit, as
  their chat templates ask: each call a JSON object in its own block,

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Text outside the blocks is the reply's content.
- `qwen3_coder`, Qwen3-Coder's calls: the same blocks, each call written as XML elements with
  the values as raw text, read by the types the request's tool schema gives them
  (draftsman/tool_call_xml.py).
- `llama3_json`, Llama 3.1 / 3.2's JSON tool calling: the whole reply is the calls, JSON objects
  {"name": ..., "parameters": {...}} separated by ";" (the <|python_tag|> before them is a
  special token, which decoded text drops). A streamed reply that starts with "{" is held to its
  end, since only the end tells a call from text.
- `pythonic`, Llama 3.2 / Llama 4's (and ToolACE's) Python-style calls: the whole reply is a list
  of calls with keyword arguments written as Python literals,

      [get_weather(city="Paris", unit="C"), get_time()]

  (Llama 4's <|python_start|> / <|python_end|> around it are special tokens, dropped). A streamed
  reply that starts with "[" is held to its end, as llama3_json's "{" is.

A block or reply that is not such a call (bad JSON, no name, arguments with NaN or Infinity, which
are not JSON) stays in the content as the model wrote it: nothing is dropped. The content beside
calls is as written (vLLM's parsers do not strip it), so a stream's pieces join to it. Parsing
reads the output only; it does not steer generation, so the output stays exactly the target's.
"""
from __future__ import annotations

import ast
import json
import uuid

from .tool_call_mistral import CALLS as MISTRAL_CALLS
from .tool_call_mistral import MARKERS as MISTRAL_MARKERS
from .tool_call_mistral import mistral_call_id, mistral_call_parts
from .tool_call_xml import xml_calls_parts

PARSERS = ("hermes", "qwen3_coder", "llama3_json", "pythonic", "mistral")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# What each format needs decoded text to keep, where the tokenizer must not drop it as special.
TAGS = {"hermes": (OPEN, CLOSE), "qwen3_coder": (OPEN, CLOSE), "llama3_json": (), "pythonic": (), "mistral": ()}
# Special tokens a format needs in decoded text: its replies keep them there (generate's keep_in_text).
KEPT_IN_TEXT = {"mistral": MISTRAL_MARKERS}


def tool_call(name: str, arguments, call_id: str | None = None) -> dict:
    """One call in OpenAI's shape: arguments as a JSON string, a fresh id (or call_id). Arguments
    with no JSON for them (NaN, Infinity, which Python's json reads) raise ValueError: a client's
    JSON.parse refuses them, so the parsers leave such a call in the content (as tool_call_xml.py
    never reads such a value as a number)."""
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False,
                                                                        allow_nan=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def read_call(name: str, arguments, call_id: str | None = None) -> dict | None:
    """tool_call for a call read from the output, or None when its arguments have no JSON (the
    parsers then leave it in the content)."""
    try:
        return tool_call(name, arguments, call_id)
    except ValueError:
        return None


def _mistral_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """mistral: (content, calls) of a reply that holds them, else None (draftsman/tool_call_mistral.py)."""
    parsed = mistral_call_parts(text)
    if parsed is None:
        return None
    content, parts = parsed
    calls = [read_call(name, arguments, mistral_call_id()) for name, arguments in parts]
    return None if None in calls else (content, calls)  # a call with no JSON for it: the reply is content


def _json_calls_of(block: str, tools: list[dict] | None = None) -> list[dict] | None:
    """hermes: the call a block's JSON holds (a list of one), or None when it holds none."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    call = read_call(value["name"], value.get("arguments", {}))
    return None if call is None else [call]


def _xml_calls_of(block: str, tools: list[dict] | None = None) -> list[dict] | None:
    """qwen3_coder: the calls a block's elements hold, or None when it holds none."""
    parts = xml_calls_parts(block, tools)
    return [tool_call(*call) for call in parts] if parts is not None else None  # (XML values are never NaN)


# Formats whose calls are blocks in the tags: each block's parse (block text, the request's tools) -> its calls.
BLOCK_CALLS = {"hermes": _json_calls_of, "qwen3_coder": _xml_calls_of}


def parse_tool_calls(text: str, parser: str = "hermes",
                     tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """A whole reply -> (its content, None when only calls; its calls in order). tools: the
    request's tool definitions (qwen3_coder reads its values' types from them)."""
    if parser == "mistral":
        parsed = _mistral_calls(text)
        return parsed if parsed is not None else (text, [])
    whole = _whole_reply(parser)
    if whole is not None:
        calls = whole[1](text)
        return (None, calls) if calls else (text, [])
    content, calls, rest = [], [], text
    while OPEN in rest:
        before, after = rest.split(OPEN, 1)
        if CLOSE not in after:  # an unclosed block: the model stopped inside it
            break
        block, rest = after.split(CLOSE, 1)
        block_calls = BLOCK_CALLS[parser](block, tools)
        content.append(before if block_calls is not None else before + OPEN + block + CLOSE)
        calls += block_calls or []
    content.append(rest)
    if not calls:
        return text, []
    return content_beside_calls("".join(content)), calls


def content_beside_calls(content: str) -> str | None:
    """The content of a reply with calls: as written, as vLLM's parsers return the text before a call
    (unstripped, so the streamed pieces join to it), and None when it is only white space."""
    return content if content.strip() else None


def _json_calls(text: str) -> list[dict]:
    """llama3_json: the calls that make up the whole reply, or [] when it is not only calls."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    text = text.strip()
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return []
        arguments = value.get("parameters", value.get("arguments", {})) if isinstance(value, dict) else None
        if not isinstance(value.get("name") if isinstance(value, dict) else None, str) or \
                not isinstance(arguments, (dict, str)):
            return []
        call = read_call(value["name"], arguments)
        if call is None:  # arguments with no JSON for them (NaN)
            return []
        calls.append(call)
        at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
    return calls


def _pythonic_calls(text: str) -> list[dict]:
    """pythonic: the calls that make up the whole reply, a Python list of calls with keyword
    arguments written as literals; [] when the reply is anything else (as vLLM reads it)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")  # stripped: Python refuses an indented first line
    except (SyntaxError, ValueError, RecursionError):
        return []
    if not isinstance(tree.body, ast.List):
        return []
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args or \
                any(keyword.arg is None for keyword in node.keywords):  # positional or **arguments: no names
            return []
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            calls.append(tool_call(node.func.id, arguments))
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or no JSON for it (a set, inf)
            return []
    return calls


# Formats whose calls are the whole reply: the character such a reply starts with, and its parse.
WHOLE_REPLY_CALLS = {"llama3_json": ("{", _json_calls), "pythonic": ("[", _pythonic_calls)}


def _whole_reply(parser) -> tuple | None:
    """(opener, parse) of a format whose calls are the whole reply, else None: a name in
    WHOLE_REPLY_CALLS, or an object that has them (draftsman/forced_calls.py's ForcedCalls)."""
    if isinstance(parser, str):
        return WHOLE_REPLY_CALLS.get(parser)
    return parser.opener, parser.parse


def tool_call_stream(parser, tools: list[dict] | None = None):
    """A streamed reply's parser for the format (tools: as parse_tool_calls takes them)."""
    if parser == "mistral":
        return MistralCallStream()
    whole = _whole_reply(parser)
    return WholeReplyCallStream(*whole) if whole is not None else ToolCallStream(parser, tools)


class WholeReplyCallStream:
    """llama3_json's and pythonic's stream: a reply that starts as calls do ("{", "[") after white
    space is held to its end and sent as its calls, or as content when it is not only calls; any
    other reply is content as it comes."""

    def __init__(self, opener: str, parse):
        self.opener, self.parse = opener, parse
        self.held = ""
        self.mode = "undecided"  # then "calls" (held to the end) or "content"
        self.calls = 0

    def feed(self, piece: str) -> list[dict]:
        if self.mode == "content":
            return _content(piece)
        self.held += piece
        if self.mode == "undecided" and self.held.strip():
            self.mode = "calls" if self.held.lstrip().startswith(self.opener) else "content"
            if self.mode == "content":
                held, self.held = self.held, ""
                return _content(held)
        return []

    def finish(self) -> list[dict]:
        held, self.held = self.held, ""
        calls = self.parse(held) if self.mode == "calls" else []
        if not calls:
            return _content(held)
        self.calls = len(calls)
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]


class ToolCallStream:
    """hermes' and qwen3_coder's stream: a streamed reply's pieces -> OpenAI chat deltas: content
    as it comes, except text that may open a block (held until it does or cannot); each call whole,
    as its block closes."""

    def __init__(self, parser: str = "hermes", tools: list[dict] | None = None):
        self.calls_of, self.tools = BLOCK_CALLS[parser], tools
        self.content = ContentGate()
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
                    deltas += self.content.feed(before)
                    self.inside = True
                    continue
                keep = tag_start_at_end(self.held, OPEN)  # the end of the text may be the start of OPEN
                deltas += self.content.feed(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return deltas
            if CLOSE not in self.held:
                return deltas
            block, self.held = self.held.split(CLOSE, 1)
            self.inside = False
            calls = self.calls_of(block, self.tools)
            if calls is None:
                deltas += self.content.feed(OPEN + block + CLOSE)
            for call in calls or []:
                deltas.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1

    def finish(self) -> list[dict]:
        """The text still held when the reply ends (an unclosed block is content)."""
        held, self.held = (OPEN if self.inside else "") + self.held, ""
        self.inside = False
        return self.content.finish(held, had_calls=self.calls > 0)


class MistralCallStream:
    """mistral's stream: content as it comes until [TOOL_CALLS] (text that may be its start held
    until the next piece tells); from there the reply is held to its end and sent as its calls,
    or as content when it is not calls."""

    def __init__(self):
        self.held = ""
        self.in_calls = False
        self.calls = 0
        self.content = ContentGate()

    def feed(self, piece: str) -> list[dict]:
        self.held += piece
        if self.in_calls:
            return []
        if MISTRAL_CALLS in self.held:
            before, after = self.held.split(MISTRAL_CALLS, 1)
            self.held, self.in_calls = MISTRAL_CALLS + after, True
            return self.content.feed(before)
        keep = tag_start_at_end(self.held, MISTRAL_CALLS)
        sent, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return self.content.feed(sent)

    def finish(self) -> list[dict]:
        held, self.held = self.held, ""
        parsed = _mistral_calls(held) if self.in_calls else None
        if parsed is None:
            return self.content.finish(held, had_calls=False)
        _, calls = parsed  # (no content: what came before the marker was sent)
        self.calls = len(calls)
        return self.content.finish("", had_calls=True) + \
            [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]


class ContentGate:
    """A stream's content as content_beside_calls gives the whole reply's: white space that opens
    it is held until text follows, and dropped when the reply turns out to be only calls."""

    def __init__(self):
        self.space = ""  # white space not yet sent: all the content so far
        self.opened = False  # text other than white space was sent

    def feed(self, text: str) -> list[dict]:
        if self.opened:
            return _content(text)
        self.space += text
        if not self.space.strip():
            return []
        self.opened, text, self.space = True, self.space, ""
        return _content(text)

    def finish(self, text: str, had_calls: bool) -> list[dict]:
        """The reply's last text: white space alone beside calls is no content."""
        deltas = self.feed(text)
        space, self.space = self.space, ""
        return deltas + ([] if had_calls else _content(space))


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
