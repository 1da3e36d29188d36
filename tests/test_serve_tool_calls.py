"""Tool calls (`draftsman serve --tool-call-parser hermes`, draftsman/tool_calls.py): a chat reply's
<tool_call>{json}</tool_call> blocks come back as OpenAI's tool_calls, whole or streamed; the
request's tool_choice is checked; earlier calls' arguments reach the chat template as objects.
The tiny target writes no calls of its own, so the answer's shaping is tested on replies the
server's batcher is made to return, and the real path on the tiny target's own replies."""
import argparse
import json
import random
import shutil
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from draftsman import cli
from draftsman.api import GenerationOutput, GenerationStats
from draftsman.tool_calls import TAGS, ToolCallStream, arguments_as_objects, parse_tool_calls, tool_call_stream
from serving import call, events, ngram_decoder, running

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
TIME = {"name": "get_time", "arguments": {}}
REPLY = (f"Let me look.\n<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n"
         f"<tool_call>\n{json.dumps(TIME)}\n</tool_call>")
# Its content beside the calls, as written (vLLM's hermes parser returns the text before a call
# unstripped), so the streamed pieces join to it.
CONTENT = "Let me look.\n\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def calls_of(calls: list[dict]) -> list[tuple]:
    """(name, arguments as an object) of each call: the ids are fresh."""
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_reply_is_split_into_content_and_calls():
    content, calls = parse_tool_calls(REPLY)
    assert content == CONTENT and calls_of(calls) == [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls(f"<tool_call>{json.dumps(TIME)}</tool_call>")
    assert content is None and calls_of(calls) == [("get_time", {})]
    string_arguments = {"name": "f", "arguments": '{"a": 1}'}  # kept as the model wrote it
    assert parse_tool_calls(f"<tool_call>{json.dumps(string_arguments)}</tool_call>")[1][0]["function"]["arguments"] \
        == '{"a": 1}'
    for text in ("no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 f"<tool_call>{json.dumps(TIME)}"):  # bad JSON, no name, unclosed: the text as written
        assert parse_tool_calls(text) == (text, [])
    content, calls = parse_tool_calls(f"a<tool_call>[1]</tool_call>b<tool_call>{json.dumps(TIME)}</tool_call>")
    assert content == "a<tool_call>[1]</tool_call>b" and calls_of(calls) == [("get_time", {})]


@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_reply_gives_what_the_whole_reply_gives(seed):
    """The reply cut into random pieces (single characters too, cuts inside the tags): the
    content deltas join to the whole reply's content, the calls arrive whole, indexed in order."""
    rng = random.Random(seed)
    # A block that holds no call (its text is content), and an end that might have opened a block.
    text = REPLY + "\n<tool_call>[1]</tool_call>\nDone <tool" + ("_x" if seed % 2 else "")
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, len(text) // 3)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream, deltas = ToolCallStream(), []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    whole_content, whole_calls = parse_tool_calls(text)
    assert content == whole_content and calls_of(calls) == calls_of(whole_calls)  # exactly: nothing stripped
    assert [c["index"] for c in calls] == [0, 1] and stream.calls == 2
    assert all(set(d) in ({"content"}, {"tool_calls"}) and (d.get("content") != "") for d in deltas)


def test_text_that_only_looked_like_an_opening_is_sent():
    stream = ToolCallStream()
    assert stream.feed("a <tool") == [{"content": "a "}]
    assert stream.feed("box") == [{"content": "<toolbox"}]
    assert stream.feed(f"<tool_call>{json.dumps(TIME)}") == []  # inside an open block: held
    assert stream.finish() == [{"content": f"<tool_call>{json.dumps(TIME)}"}]  # unclosed: content


def test_earlier_calls_arguments_reach_the_template_as_objects():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}, *USER]
    out = arguments_as_objects(messages)
    assert [c["function"]["arguments"] for c in out[0]["tool_calls"]] == [{"a": 1}, "not json"]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request is not changed
    assert out[1] is USER[0]


TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_server(chat_target, tmp_path_factory):
    """(server, base URL): the tiny chat target with a template that reads tools, served with
    --tool-call-parser hermes."""
    folder = tmp_path_factory.mktemp("tool-target")
    shutil.copytree(chat_target[0], folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(folder)
    with running(ngram_decoder(folder), tool_call_parser="hermes") as served:
        yield served


def replying(server, monkeypatch, text: str, reason: str = "eos"):
    """The server's batcher returns `text` as each request's reply (one row), whole or streamed
    in pieces of 5 characters."""
    def generate(ids, args, gone=None):
        return GenerationOutput([text], [[1] * 3], GenerationStats(finish_reasons=[reason])), 1

    def stream(ids, args, gone=None):
        job = SimpleNamespace(rows=1, stats=GenerationStats(finish_reasons=[reason]), batch_rows=1, cancel=lambda: None)
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        chunks = [(0, SimpleNamespace(text=p, token_ids=[1], logprobs=None, top_logprobs=None, finish_reason=None))
                  for p in pieces]
        chunks[-1][1].finish_reason = reason
        return job, iter(chunks)

    monkeypatch.setattr(server.batcher, "generate", generate)
    monkeypatch.setattr(server.batcher, "stream", stream)


@pytest.mark.parametrize("choice", [None, "auto"])
def test_a_reply_with_calls_is_answered_with_tool_calls(tool_server, monkeypatch, choice):
    server, base = tool_server
    replying(server, monkeypatch, REPLY)
    asked = {"tool_choice": choice, "parallel_tool_calls": True} if choice else {}
    body = {"messages": USER, "tools": TOOLS, **asked}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200, got
    choice = got["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == CONTENT
    assert calls_of(choice["message"]["tool_calls"]) == [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})]


def test_parallel_tool_calls_false_keeps_the_first_call(tool_server, monkeypatch):
    """parallel_tool_calls false: a reply of two calls comes back with the first only, whole and
    streamed (vLLM's reading: the calls after it are dropped); the text before them stays."""
    server, base = tool_server
    replying(server, monkeypatch, REPLY)
    body = {"messages": USER, "tools": TOOLS, "parallel_tool_calls": False}
    status, got = call(base, "/v1/chat/completions", body)
    choice = got["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == CONTENT
    assert calls_of(choice["message"]["tool_calls"]) == [(WEATHER["name"], WEATHER["arguments"])]
    deltas = [e["choices"][0]["delta"] for e in events(base, "/v1/chat/completions", {**body, "stream": True})]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0] and calls_of(calls) == [(WEATHER["name"], WEATHER["arguments"])]


def test_a_streamed_reply_with_calls_sends_tool_calls_deltas(tool_server, monkeypatch):
    server, base = tool_server
    replying(server, monkeypatch, REPLY + " <tool")  # its end held as a possible opening, then sent
    got = events(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in got]
    assert deltas[0] == {"role": "assistant", "content": ""} and all(deltas[1:-1])  # no empty events
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n\n <tool"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 1]
    assert calls_of(calls) == [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})]
    assert [e["choices"][0]["finish_reason"] for e in got] == [None] * (len(got) - 1) + ["tool_calls"]
    assert not any("<tool_call" in d.get("content", "") for d in deltas)


@pytest.mark.parametrize("body, reason, parsed", [
    ({"tools": TOOLS, "tool_choice": "none"}, "eos", False),  # the reply as text
    ({}, "eos", False),  # no tools sent: nothing to call
    ({"tools": TOOLS}, "length", True),  # cut off after its calls: still "length"
])
def test_replies_that_are_not_tool_calls_stay_text(tool_server, monkeypatch, body, reason, parsed):
    server, base = tool_server
    replying(server, monkeypatch, REPLY, reason)
    status, got = call(base, "/v1/chat/completions", {"messages": USER, **body})
    choice = got["choices"][0]
    assert status == 200 and ("tool_calls" in choice["message"]) == parsed
    assert choice["message"]["content"] == (CONTENT if parsed else REPLY)
    assert choice["finish_reason"] == ("length" if reason == "length" else "stop")


def test_the_tiny_targets_own_reply_with_tools(tool_server):
    """The real path: the template renders the tools and an earlier call (its arguments sent as
    a JSON string, rendered as an object); the tiny target writes no call, so its reply is text."""
    _, base = tool_server
    earlier = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    status, got = call(base, "/tokenize", {"messages": earlier, "tools": TOOLS})
    assert status == 200
    status, text = call(base, "/detokenize", {"tokens": got["tokens"]})
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text["prompt"]
    assert '"name": "get_weather", "parameters"' in text["prompt"]
    status, got = call(base, "/v1/chat/completions", {"messages": earlier, "tools": TOOLS, "tool_choice": "auto",
                                                      "max_tokens": 8, "temperature": 0})
    assert status == 200 and isinstance(got["choices"][0]["message"]["content"], str)
    assert got["choices"][0]["finish_reason"] in ("stop", "length") and "tool_calls" not in got["choices"][0]["message"]


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS, "tool_choice": "requird"}, '"tool_choice" must be "auto", "none", "required" or'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, '"tool_choice" must be'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
     "names function 'get_wether', which \"tools\" does not define; defined: ['get_weather']"),
    ({"tool_choice": "auto"}, '"tool_choice" goes with "tools"'),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, '"parallel_tool_calls" must be true or false, got "yes"'),
])
def test_tool_choices_that_cannot_be_served_are_named(tool_server, body, message):
    _, base = tool_server
    status, got = call(base, "/v1/chat/completions", {"messages": USER, **body})
    assert status == 400 and message in got["error"]["message"]


def test_auto_tool_choice_needs_a_parser(served):
    _, base = served
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "auto"})
    assert status == 400 and "needs the server started with --tool-call-parser" in got["error"]["message"]


def test_the_parser_is_checked_when_the_server_starts(chat_target, capsys):
    from draftsman.serve import Server

    with pytest.raises(ValueError, match="'xml' is not known; the parsers are: hermes, qwen3_coder, llama3_json, "
                                         "pythonic"):
        Server(ngram_decoder(chat_target[0]), "tiny", "127.0.0.1", 0, tool_call_parser="xml")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--drafter", "ngram", "--tool-call-parser", "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err


def test_a_target_whose_text_drops_the_tags_is_refused():
    """A tokenizer that marks <tool_call> special drops it from decoded text: no call would be seen."""
    from draftsman.replies import check_parser

    tokenizer = SimpleNamespace(all_special_tokens=["<|im_end|>", "<tool_call>"])
    with pytest.raises(ValueError, match="marks <tool_call> / </tool_call> as special tokens"):
        check_parser("--tool-call-parser", "hermes", TAGS, tokenizer)
    assert check_parser("--tool-call-parser", "llama3_json", TAGS, tokenizer) == "llama3_json"  # no tags to keep
    assert check_parser("--tool-call-parser", "pythonic", TAGS, tokenizer) == "pythonic"
    tokenizer.all_special_tokens = ["<|im_end|>"]
    assert check_parser("--tool-call-parser", "hermes", TAGS, tokenizer) == "hermes"


LLAMA_REPLY = (f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER["arguments"])}}}; '
               '{"name": "get_time", "parameters": {}}')
LLAMA_CASES = {  # llama3_json: a reply -> its calls, or None when it is content
    LLAMA_REPLY: [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})],
    '\n {"name": "get_time", "arguments": {"zone": "CET"}}\n': [("get_time", {"zone": "CET"})],  # "arguments" too
    "The weather is fine.": None,
    '{"name": "get_time", "parameters": {}} and then some text': None,  # not only calls
    '{"temperature": 18}': None,  # JSON, but no call
    '{"name": "get_time", "parameters": {': None,  # cut off
}
PYTHONIC_REPLY = '[get_weather(city="Paris", unit="C"), get_time()]'
PYTHONIC_CASES = {  # pythonic: a reply -> its calls, or None when it is content
    PYTHONIC_REPLY: [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})],
    ' \n  [find(tags=["a", "b"], limit=-2, exact=True, near=None, box=(1, 2.5), opts={"k": {"deep": [1]}})]\n':
        [("find", {"tags": ["a", "b"], "limit": -2, "exact": True, "near": None, "box": [1, 2.5],
                   "opts": {"k": {"deep": [1]}}})],  # Python literals, as JSON
    "[get_time()] and then some text": None,  # not only calls
    "The list is [1, 2].": None,
    "[1, 2]": None,  # a list, but no calls
    "[]": None,
    "get_time(), get_date()": None,  # calls, but not in a list
    '[get_weather("Paris")]': None,  # a positional argument has no name
    "[get_weather(city=paris)]": None,  # not a literal
    '[get_weather(**{"city": "Paris"})]': None,  # no argument names
    "[get_weather(city={1, 2})]": None,  # a set: no JSON for it
    "[tools.get_weather(city='Paris')]": None,  # not a plain name
    '[get_weather(city="Par': None,  # cut off
}
# The formats whose calls are the whole reply: parser -> its cases.
WHOLE_REPLY_CASES = {"llama3_json": LLAMA_CASES, "pythonic": PYTHONIC_CASES}
WHOLE_REPLIES = [(parser, text) for parser, cases in WHOLE_REPLY_CASES.items() for text in cases]


@pytest.mark.parametrize("parser, text", WHOLE_REPLIES)
def test_whole_reply_calls_are_calls_only_when_the_reply_is_wholly_calls(parser, text):
    content, calls = parse_tool_calls(text, parser)
    if WHOLE_REPLY_CASES[parser][text] is None:
        assert (content, calls) == (text, [])
    else:
        assert content is None and calls_of(calls) == WHOLE_REPLY_CASES[parser][text]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("parser, text", WHOLE_REPLIES)
def test_a_streamed_whole_reply_format_gives_what_the_whole_reply_gives(parser, text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 10))))
    stream, deltas = tool_call_stream(parser), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.finish()
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    content = "".join(d.get("content", "") for d in deltas)
    if WHOLE_REPLY_CASES[parser][text] is None:
        assert content == text and not calls
    else:
        assert content == "" and calls_of(calls) == WHOLE_REPLY_CASES[parser][text]
        assert [c["index"] for c in calls] == list(range(len(calls)))


def test_a_whole_reply_formats_text_streams_as_it_comes_and_a_possible_call_is_held():
    stream = tool_call_stream("llama3_json")
    assert stream.feed("  ") == [] and stream.feed("The") == [{"content": "  The"}]
    assert stream.feed(" weather") == [{"content": " weather"}] and stream.finish() == []
    stream = tool_call_stream("pythonic")
    assert stream.feed(" The") == [{"content": " The"}] and stream.feed(" list") == [{"content": " list"}]
    stream = tool_call_stream("pythonic")
    assert stream.feed("[get_time(") == [] and stream.feed(")]") == []  # may be calls: held to the end
    assert calls_of([d["tool_calls"][0] for d in stream.finish()]) == [("get_time", {})]


@pytest.mark.parametrize("parser, reply", [("llama3_json", LLAMA_REPLY), ("pythonic", PYTHONIC_REPLY)])
def test_a_whole_reply_of_calls_is_answered_with_tool_calls(tool_server, monkeypatch, parser, reply):
    with running(ngram_decoder(tool_server[0].decoder.config["target"]["path"]),
                 tool_call_parser=parser) as (server, base):
        replying(server, monkeypatch, reply)
        status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
        choice = got["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert calls_of(choice["message"]["tool_calls"]) == WHOLE_REPLY_CASES[parser][reply]
        streamed = events(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in streamed]
        assert calls_of([d["tool_calls"][0] for d in deltas if "tool_calls" in d]) == WHOLE_REPLY_CASES[parser][reply]
        assert not any(d.get("content") for d in deltas)
        assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_vllms_enable_auto_tool_choice_flag_is_taken(capsys):
    """vLLM command lines carry --enable-auto-tool-choice with the parser: taken as they are
    (auto is served whenever a parser is named); alone it is refused before any model loads."""
    from draftsman.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]).enable_auto_tool_choice
    assert cli.main(["serve", "--set", "target.path=/no/such/model", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0] is not a function tool"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] is not a function tool"),  # (a 200 before, as "auto")
    ({"tools": TOOLS, "messages": [*USER, {"role": "assistant", "tool_calls": {"id": "c1"}}]},
     "message 1: 'tool_calls' must be a list of calls"),  # was the template's "'str object' has no attribute"
])
def test_bad_tools_get_a_400(tool_server, body, message):
    status, got = call(tool_server[1], "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **body})
    assert status == 400 and message in got["error"]["message"], got


# (parser, reply with content and calls, its content). vLLM's parsers return the text before a call
# unstripped; white space alone beside the calls is no content.
AS_WRITTEN = [
    ("hermes", f"Sure.\n<tool_call>\n{json.dumps(TIME)}\n</tool_call>\n", "Sure.\n\n"),
    ("hermes", f"\n<tool_call>{json.dumps(TIME)}</tool_call>\n<tool_call>{json.dumps(TIME)}</tool_call>\n", None),
    ("qwen3_coder", "  Sure.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "  Sure.\n"),
    ("mistral", 'Sure.\n[TOOL_CALLS]get_time[ARGS]{}', "Sure.\n"),
    ("mistral", ' \n[TOOL_CALLS]get_time[ARGS]{}', None),
]


@pytest.mark.parametrize("parser, text, content", AS_WRITTEN)
def test_content_beside_calls_is_as_written_whole_and_streamed(parser, text, content):
    """The whole reply's content is what its streamed pieces join to (it was stripped whole only)."""
    assert parse_tool_calls(text, parser)[0] == content
    for size in (1, 3, len(text)):
        stream, deltas = tool_call_stream(parser), []
        for at in range(0, len(text), size):
            deltas += stream.feed(text[at:at + size])
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == (content or "") and stream.calls >= 1
        assert all(d.get("content") != "" for d in deltas)


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": Infinity}}'),
    ("pythonic", "[f(a=1e999)]"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": -Infinity}'),
])
def test_arguments_with_no_json_for_them_are_not_calls(parser, text):
    """NaN and Infinity, which Python's json reads, are not JSON: a client's JSON.parse refused the
    arguments. Such a call stays content, as tool_call_xml never reads such a value as a number."""
    assert parse_tool_calls(text, parser) == (text, [])
    stream, deltas = tool_call_stream(parser), []
    for piece in (text[:7], text[7:]):
        deltas += stream.feed(piece)
    deltas += stream.finish()
    assert "".join(d.get("content", "") for d in deltas) == text and stream.calls == 0
