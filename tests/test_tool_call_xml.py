"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`, draftsman/tool_call_xml.py):
each value read by the type the request's tool schema gives it, whole replies and streamed ones
alike, through serve and Decoder.chat; a block that is not wholly a call stays content."""
import random

import pytest

from draftsman.tool_call_xml import typed_value
from draftsman.tool_calls import parse_tool_calls, tool_call_stream
from serving import call, events, ngram_decoder, running
from test_serve_tool_calls import USER, calls_of, replying, tool_server  # noqa: F401 (a fixture)

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "score": {"type": "number"},
    "exact": {"type": "boolean"}, "tags": {"type": "array"}, "filters": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def element(name: str, **values: str) -> str:
    """A call as Qwen3-Coder writes it: each value on its own lines."""
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


SEARCH = element("search", query="007", limit="5", score="0.5", exact="TRUE", tags='["a", "b"]',
                 filters='{"lang": "py"}')
REPLY = f"I will search.\n{SEARCH}\n{element('get_time')}"
CALLS = [("search", {"query": "007", "limit": 5, "score": 0.5, "exact": True, "tags": ["a", "b"],
                     "filters": {"lang": "py"}}), ("get_time", {})]

TYPED = [  # text, schema -> value
    ("007", {"type": "string"}, "007"), ("null", {"type": "integer"}, None), ("NULL", {"type": "string"}, None),
    ("42", {"type": "integer"}, 42), ("4.2", {"type": "integer"}, "4.2"), ("-3", {"type": "int64"}, -3),
    ("2.0", {"type": "number"}, 2), ("2.5", {"type": "number"}, 2.5), ("inf", {"type": "number"}, "inf"),
    ("many", {"type": "number"}, "many"), ("False", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1], "b": true, "c": null}', {"type": "object"}, {"a": [1], "b": True, "c": None}), ("{'a': (1,)}", {"type": "object"}, {"a": (1,)}),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("{1, 2}", {"type": "array"}, "{1, 2}"),  # no JSON for a set
    ("12", None, "12"),  # a parameter the schema does not name: the text
    ("12", {"description": "no type"}, "12"), ("12", {"type": "custom"}, 12),  # other types: a literal if one
]


@pytest.mark.parametrize("text, schema, value", TYPED)
def test_a_value_is_read_as_its_schema_type(text, schema, value):
    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


def test_a_reply_is_split_into_content_and_typed_calls():
    content, calls = parse_tool_calls(REPLY, "qwen3_coder", TOOLS)
    assert content == "I will search.\n\n" and calls_of(calls) == CALLS  # as written, as vLLM's
    _, untyped = parse_tool_calls(REPLY, "qwen3_coder")  # no tools: every value is its text
    assert calls_of(untyped)[0][1] == {"query": "007", "limit": "5", "score": "0.5", "exact": "TRUE",
                                       "tags": '["a", "b"]', "filters": '{"lang": "py"}'}
    flat = [{"type": "function", "function": {"name": "get_time", "parameters": {"zone": {"type": "integer"}}}}]
    assert calls_of(parse_tool_calls(element("get_time", zone="2"), "qwen3_coder", flat)[1]) == [("get_time", {"zone": 2})]
    multiline = element("search", query="line one\nline two\n")  # only the format's own lines are removed
    assert calls_of(parse_tool_calls(multiline, "qwen3_coder", TOOLS)[1]) == [("search", {"query": "line one\nline two\n"})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",  # no </function>
    "<tool_call>\n<function=search>\nlook: <parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",  # stray text
    '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',  # hermes' JSON is not this format
    "<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>",  # unclosed parameter
    "<tool_call><function=search></function> and more</tool_call>",
])
def test_a_block_that_is_not_wholly_a_call_stays_content(text):
    assert parse_tool_calls(f"Hi {text}", "qwen3_coder", TOOLS) == (f"Hi {text}", [])


@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_reply_gives_what_the_whole_reply_gives(seed):
    rng = random.Random(seed)
    text = REPLY + "\n<tool_call><function=x>oops</tool_call> done <tool_c"
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, len(text) // 4)))
    stream, deltas = tool_call_stream("qwen3_coder", TOOLS), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.finish()
    whole_content, whole_calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    assert "".join(d.get("content", "") for d in deltas) == whole_content
    assert calls_of([d["tool_calls"][0] for d in deltas if "tool_calls" in d]) == calls_of(whole_calls) == CALLS


def test_serve_types_the_values_by_the_requests_tools(tool_server, monkeypatch):  # noqa: F811
    with running(ngram_decoder(tool_server[0].decoder.config["target"]["path"]),
                 tool_call_parser="qwen3_coder") as (server, base):
        replying(server, monkeypatch, REPLY)
        status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
        choice = got["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "I will search.\n\n" and calls_of(message["tool_calls"]) == CALLS
        streamed = events(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in streamed]
        assert calls_of([d["tool_calls"][0] for d in deltas if "tool_calls" in d]) == CALLS
        assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_block_may_hold_several_functions():
    """vLLM's qwen3_coder parser reads every <function=...> in a block (they stayed content)."""
    text = "<tool_call>\n<function=search>\n<parameter=limit>\n5\n</parameter>\n</function>\n" \
           "<function=get_time>\n</function>\n</tool_call>"
    content, calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    assert content is None and calls_of(calls) == [("search", {"limit": 5}), ("get_time", {})]
    stream, deltas = tool_call_stream("qwen3_coder", TOOLS), []
    for at in range(0, len(text), 4):
        deltas += stream.feed(text[at:at + 4])
    deltas += stream.finish()
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in streamed] == [0, 1] and calls_of(streamed) == calls_of(calls)
    assert not any("content" in d for d in deltas)
    stray = text.replace("<function=get_time>", "x <function=get_time>")  # text between them: not wholly calls
    assert parse_tool_calls(stray, "qwen3_coder", TOOLS) == (stray, [])
