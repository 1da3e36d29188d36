"""Forced tool calls (draftsman/forced_calls.py): tool_choice "required" or a named function holds
the reply to calls by a grammar, and the calls come back as OpenAI's tool_calls, whole or
streamed, equal to the target's output under that grammar through the Python API."""
import json
import shutil

import pytest
from transformers import AutoTokenizer

from draftsman.api import GenerationOutput, GenerationStats
from draftsman.forced_calls import ForcedCalls
from draftsman.verifier.structured import StructuredOutput
from serving import call, events, ngram_decoder, running
from test_serve_tool_calls import REPLY, TOOL_TEMPLATE

UNIT = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}
DAY = {"type": "object", "properties": {"day": {"$ref": "#/$defs/day"}}, "required": ["day"],
       "additionalProperties": False, "$defs": {"day": {"enum": ["mon", "tue"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_day", "parameters": DAY}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
LONG = 60  # room for the calls to close


@pytest.fixture(scope="module")
def server(chat_target, tmp_path_factory):
    """The tiny chat target with a template that reads tools, served without --tool-call-parser
    (a forced call needs none)."""
    folder = tmp_path_factory.mktemp("forced-target")
    shutil.copytree(chat_target[0], folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # the tools' names only: their schemas as JSON would fill the tiny target's 256 positions
    tokenizer.chat_template = TOOL_TEMPLATE.replace("{{ t | tojson }}", "{{ t['function']['name'] }} ")
    assert tokenizer.chat_template != TOOL_TEMPLATE
    tokenizer.save_pretrained(folder)
    decoder = ngram_decoder(folder)
    with running(decoder) as (_, base):
        yield decoder, base


def test_the_schemas_and_how_replies_read_back():
    named = ForcedCalls(TOOLS, "get_day")
    assert named.structured_output == {"json": DAY, "disable_any_whitespace": True}
    assert named.opener == "{" and named.keeps_stop
    assert [c["function"] for c in named.parse(' {"day": "mon"}')] == [{"name": "get_day",
                                                                      "arguments": '{"day": "mon"}'}]
    assert named.parse('{"day": "mo') == [] and named.parse("[1]") == []
    required = ForcedCalls(TOOLS)
    schema = required.structured_output["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and required.opener == "[" and not required.keeps_stop
    assert schema["$defs"] == DAY["$defs"] and '"$defs":' not in json.dumps(schema["items"])  # hoisted to the root
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                 {"const": "get_day"}]
    calls = required.parse('[{"name": "get_weather", "parameters": {"unit": "C"}}, {"name": "get_day", '
                           '"parameters": {"day": "tue"}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"unit": "C"}), ("get_day", {"day": "tue"})]
    assert required.parse('[{"name": "get_weather"') == [] and required.parse('{"name": "x"}') == []
    with pytest.raises(ValueError, match="names function 'get_time', which \"tools\" does not define"):
        ForcedCalls(TOOLS, "get_time")
    other_day = {**DAY, "$defs": {"day": {"enum": ["sat"]}}}
    with pytest.raises(ValueError, match="define \"\\$defs\" 'day' differently"):
        ForcedCalls([*TOOLS, {"type": "function", "function": {"name": "get_sat", "parameters": other_day}}])


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_is_the_targets_output_under_its_grammar(server, choice):
    decoder, base = server
    forced = ForcedCalls(TOOLS, choice["function"]["name"] if isinstance(choice, dict) else None)
    want = decoder.chat(USER, tools=TOOLS, max_new_tokens=LONG, structured_output=forced.structured_output)
    assert want.stats.finish_reasons == ["eos"]  # the calls closed: the check below reads whole calls
    calls = forced.parse(want.texts[0])
    body = {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": LONG}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200, got
    message = got["choices"][0]["message"]
    assert message["content"] is None and [c["function"] for c in message["tool_calls"]] == [c["function"]
                                                                                             for c in calls]
    assert got["choices"][0]["finish_reason"] == ("stop" if isinstance(choice, dict) else "tool_calls")
    for c in message["tool_calls"]:  # what the grammar promised
        arguments = json.loads(c["function"]["arguments"])
        assert c["function"]["name"] in ("get_weather", "get_day")
        assert arguments in ({"unit": "C"}, {"unit": "F"}) if c["function"]["name"] == "get_weather" else \
            arguments in ({"day": "mon"}, {"day": "tue"})
    streamed = events(base, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0] for e in streamed if e["choices"]]
    stream_calls = [call_ for d in deltas for call_ in d["delta"].get("tool_calls") or []]
    assert [c["function"] for c in stream_calls] == [c["function"] for c in calls]
    assert [c["index"] for c in stream_calls] == list(range(len(calls)))
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == got["choices"][0]["finish_reason"]
    free = decoder.chat(USER, tools=TOOLS, max_new_tokens=LONG)
    assert free.texts[0] != want.texts[0]  # the grammar changed the reply


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "would constrain it too: send one"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "which \"tools\" does not define"),
    ({"tool_choice": "required", "min_tokens": 3}, "holds EOS back"),
    # A schema that is no object dropped the connection without an answer (an AttributeError).
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tool 'f': \"parameters\" must be a JSON schema object"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "$defs": [1]}}}]}, "its \"$defs\" an object of schemas"),
    # A schema that does not compile was named as a "structured_output" the client never sent.
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}]}, "tool 'f': \"parameters\" is not a JSON schema that can hold a forced call (Invalid"),
])
def test_forced_calls_that_cannot_be_served_are_named(server, body, message):
    _, base = server
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "max_tokens": 4, **body})
    assert status == 400 and message in got["error"]["message"], got


def test_decoder_chat_takes_a_tool_choice(server):
    decoder, _ = server
    forced = ForcedCalls(TOOLS)
    out = decoder.chat(USER, tools=TOOLS, tool_choice="required", max_new_tokens=LONG)
    want = decoder.chat(USER, tools=TOOLS, max_new_tokens=LONG, structured_output=forced.structured_output)
    assert out.token_ids == want.token_ids
    message = out.messages[0]
    assert message["content"] is None and [c["function"] for c in message["tool_calls"]] == [
        c["function"] for c in forced.parse(want.texts[0])]
    named = decoder.chat(USER, tools=TOOLS, max_new_tokens=LONG,
                         tool_choice={"type": "function", "function": {"name": "get_day"}})
    assert [c["function"]["name"] for c in named.messages[0]["tool_calls"]] == ["get_day"]
    for kwargs, message in [({"tool_choice": "always"}, '"tool_choice" must be "auto", "none", "required"'),
                            ({"tool_choice": "required", "tools": None}, 'goes with "tools"'),
                            ({"tool_choice": "required", "tools": [{"type": "function"}]}, "needs each tool as"),
                            ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [{
                                "type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
                             "tool 'f': \"parameters\" is not a JSON schema that can hold a forced call"),
                            ({"tool_choice": "required", "structured_output": {"regex": "a"}}, "pass one of them")]:
        with pytest.raises(ValueError, match=message):
            decoder.chat(USER, **{"tools": TOOLS, "max_new_tokens": 4, **kwargs})


def test_tool_choice_none_leaves_the_reply_as_text(server, monkeypatch):
    """Under tool_choice "none" a reply that writes a call in the parser's format stays text."""
    decoder, _ = server
    monkeypatch.setattr(decoder, "generate", lambda **_: GenerationOutput([REPLY], [[1]], GenerationStats(
        finish_reasons=["eos"])))
    assert len(decoder.chat(USER, tools=TOOLS, tool_call_parser="hermes").messages[0]["tool_calls"]) == 2
    message = decoder.chat(USER, tools=TOOLS, tool_call_parser="hermes", tool_choice="none").messages[0]
    assert "tool_calls" not in message and message["content"] == REPLY


def test_parallel_tool_calls_false_keeps_one_call(server, monkeypatch):
    """parallel_tool_calls false: under "required" the grammar holds the reply to a list of exactly
    one call (a list of two does not parse under it), served and through Decoder.chat, equal to
    the target's output under that grammar; under "auto" a reply's first call is kept."""
    decoder, base = server
    one = ForcedCalls(TOOLS, parallel=False)
    several = ForcedCalls(TOOLS)
    assert one.structured_output["json"]["maxItems"] == 1 and "maxItems" not in several.structured_output["json"]
    two = '[{"name": "get_day", "parameters": {"day": "mon"}}, {"name": "get_day", "parameters": {"day": "tue"}}]'
    ids = decoder.tokenizer(two, add_special_tokens=False)["input_ids"]

    def parses(forced):
        return decoder.engine.grammars.matcher(StructuredOutput.parse(forced.structured_output)).validate_tokens(ids)
    assert parses(one) < len(ids) and parses(several) == len(ids)
    comma = decoder.tokenizer(",", add_special_tokens=False)["input_ids"]
    bias = {comma[0]: 8.0}  # after a call, a comma (a second call) is likelier than "]" where allowed
    assert len(comma) == 1
    free = decoder.chat(USER, tools=TOOLS, max_new_tokens=2 * LONG, structured_output=several.structured_output,
                        logit_bias=bias)
    assert free.texts[0].count('{"name": ') >= 2  # without the limit the target writes several calls
    want = decoder.chat(USER, tools=TOOLS, max_new_tokens=2 * LONG, structured_output=one.structured_output,
                        logit_bias=bias)
    calls = one.parse(want.texts[0])
    assert len(calls) == 1
    out = decoder.chat(USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       max_new_tokens=2 * LONG, logit_bias=bias)
    assert out.token_ids == want.token_ids
    assert [c["function"] for c in out.messages[0]["tool_calls"]] == [c["function"] for c in calls]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 2 * LONG, "logit_bias": {str(comma[0]): 8.0}}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200 and [c["function"] for c in got["choices"][0]["message"]["tool_calls"]] == [
        c["function"] for c in calls]
    with pytest.raises(ValueError, match="parallel_tool_calls must be True or False"):
        decoder.chat(USER, tools=TOOLS, parallel_tool_calls="no")
    monkeypatch.setattr(decoder, "generate", lambda **_: GenerationOutput([REPLY], [[1]], GenerationStats(
        finish_reasons=["eos"])))
    message = decoder.chat(USER, tools=TOOLS, tool_call_parser="hermes", parallel_tool_calls=False).messages[0]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
