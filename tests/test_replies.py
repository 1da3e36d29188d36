"""Chat replies as OpenAI's assistant messages outside the server (draftsman/replies.py):
Decoder.chat(tool_call_parser=, reasoning_parser=) and its `messages`, `draftsman generate --chat`
with the parser flags, and the terminal chat's --reasoning-parser. The tiny target writes neither
thoughts nor calls, so the shaping is tested on replies its generate / stream are made to return,
and the real path on its own replies."""
import io
import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

import draftsman
from draftsman import cli
from draftsman.api import Decoder, GenerationOutput, GenerationStats
from draftsman.interactive import converse
from draftsman.replies import DeltaPrinter, ReplyStream, message_deltas, opened_thoughts, reply_message
from test_serve_tool_calls import LLAMA_REPLY, PYTHONIC_REPLY, REPLY, TOOL_TEMPLATE, TOOLS, USER, WEATHER, calls_of

THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
NEW = 8


def whole(message: dict) -> tuple:
    """A message's parts, calls without their fresh ids, content without the white space the
    whole parse strips around calls."""
    content = message.get("content")
    return (message.get("reasoning_content"), content.strip() if content else content,
            calls_of(message.get("tool_calls", [])))


PARSED = [  # tool-call parser, reasoning parser, reply
    ("hermes", "qwen3", THOUGHT + REPLY), ("hermes", None, REPLY), (None, "qwen3", THOUGHT + "Paris."),
    ("hermes", "deepseek_r1", THOUGHT.removeprefix("<think>") + REPLY), ("llama3_json", "qwen3", THOUGHT + LLAMA_REPLY),
    ("llama3_json", None, "Sunny today."), (None, None, THOUGHT + REPLY), ("hermes", "qwen3", "Paris, <tool"),
    ("hermes", "qwen3", "Paris, <thi"), (None, "deepseek_r1", "Weighing it </thi"),  # ends that might open a tag
    ("pythonic", "qwen3", THOUGHT + PYTHONIC_REPLY), ("pythonic", None, "[1, 2] is a list."),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tool_call_parser, reasoning_parser, text", PARSED)
def test_a_streamed_reply_gives_the_whole_replys_message(tool_call_parser, reasoning_parser, text, seed):
    """The reply cut into random pieces (cuts inside the tags too) through ReplyStream: the deltas
    join to reply_message's message, and the finish reason is the same."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, len(text) // 3)))
    stream, deltas = ReplyStream(tool_call_parser, reasoning_parser), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.feed("", final=True)
    streamed = {key: "".join(d.get(key, "") for d in deltas) or None for key in ("reasoning_content", "content")}
    streamed["tool_calls"] = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    message, reason = reply_message(text, "stop", tool_call_parser, reasoning_parser)
    assert whole(streamed) == whole(message) and stream.finish_reason("stop") == reason


def test_reply_message_parts():
    message, reason = reply_message(THOUGHT + REPLY, "stop", "hermes", "qwen3")
    assert message["reasoning_content"] == "\nThe user wants the weather.\n"
    assert message["content"] == "\n\nLet me look.\n\n"  # as written: vLLM's parsers do not strip it
    assert calls_of(message["tool_calls"]) == [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})]
    assert reason == "tool_calls" and reply_message(REPLY, "length", "hermes")[1] == "length"
    assert reply_message(REPLY, "stop") == ({"role": "assistant", "content": REPLY}, "stop")  # no parsers: text
    assert message_deltas(message)[:2] == [{"reasoning_content": message["reasoning_content"]},
                                          {"content": "\n\nLet me look.\n\n"}]
    assert [d["tool_calls"][0]["index"] for d in message_deltas(message)[2:]] == [0, 1]


def test_the_printer_sets_thought_answer_and_calls_apart():
    out = io.StringIO()
    printer = DeltaPrinter(out)
    stream = ReplyStream("hermes", "qwen3")
    for i in range(0, len(THOUGHT + REPLY), 4):
        printer.write(stream.feed((THOUGHT + REPLY)[i:i + 4]))
    printer.write(stream.feed("", final=True))
    printer.end()
    assert out.getvalue() == ("[reasoning]\nThe user wants the weather.\n[answer]\nLet me look.\n"
                              f"[tool call] get_weather {json.dumps(WEATHER['arguments'])}\n[tool call] get_time {{}}\n")
    plain = io.StringIO()
    printer = DeltaPrinter(plain)
    printer.write([{"content": "\n  Paris."}])
    printer.end()
    assert plain.getvalue() == "\n  Paris.\n"  # no parts: the text as it is, no header


def with_template(chat_target, tmp_path_factory, name: str, template: str):
    """A copy of the tiny chat target whose tokenizer carries `template`."""
    folder = tmp_path_factory.mktemp(name)
    shutil.copytree(chat_target[0], folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tool_target(chat_target, tmp_path_factory):
    """The tiny chat target with a template that reads tools and earlier calls."""
    return with_template(chat_target, tmp_path_factory, "reply-target", TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def decoder(tool_target):
    return draftsman.load({"target": {"path": str(tool_target)}, "drafter": {"name": "ngram", "k": 3}})


def returning(decoder, monkeypatch, texts: list[str]):
    """decoder.generate returns `texts` (the tiny target writes no calls or thoughts)."""
    def generate(prompts=None, *, input_ids=None, **_):
        return GenerationOutput(list(texts), [[1]] * len(texts), GenerationStats(finish_reasons=["eos"] * len(texts)))

    monkeypatch.setattr(decoder, "generate", generate)


def test_chat_returns_each_reply_as_a_message(decoder):
    """The real path: without parsers each message is the reply's text; the parsers leave a
    reply that holds no thought and no call as it is."""
    out = decoder.chat([USER, USER], max_new_tokens=NEW)
    assert out.messages == [{"role": "assistant", "content": text} for text in out.texts] and len(out.texts) == 2
    parsed = decoder.chat(USER, max_new_tokens=NEW, tools=TOOLS, tool_call_parser="hermes", reasoning_parser="qwen3")
    assert parsed.token_ids == decoder.chat(USER, max_new_tokens=NEW, tools=TOOLS).token_ids  # parsing reads only
    assert parsed.messages == [{"role": "assistant", "content": parsed.texts[0] or None, "reasoning_content": None}]
    assert decoder.generate(input_ids=[[1, 2, 3]], max_new_tokens=2).messages is None  # generate: no chat


def test_chat_parses_thoughts_and_calls(decoder, monkeypatch):
    returning(decoder, monkeypatch, [THOUGHT + REPLY, "Sunny."])
    out = decoder.chat([USER, USER], tools=TOOLS, tool_call_parser="hermes", reasoning_parser="qwen3")
    assert whole(out.messages[0]) == ("\nThe user wants the weather.\n", "Let me look.",
                                      [(WEATHER["name"], WEATHER["arguments"]), ("get_time", {})])
    assert out.messages[1] == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}
    assert out.texts[0] == THOUGHT + REPLY  # the text stays the model's own


def test_a_parsed_message_goes_back_into_the_conversation(decoder, monkeypatch):
    """The reply's message appended as it comes (arguments as JSON strings, OpenAI's form) renders
    as the template renders the calls' objects."""
    returning(decoder, monkeypatch, [REPLY])
    message = decoder.chat(USER, tools=TOOLS, tool_call_parser="hermes").messages[0]
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18 C"}
    as_objects = {**message, "tool_calls": [{**c, "function": {**c["function"], "arguments": args}}
                                            for c, args in zip(message["tool_calls"], [WEATHER["arguments"], {}])]}
    want = decoder.tokenizer.apply_chat_template([*USER, as_objects, result], tools=TOOLS, add_generation_prompt=True,
                                                 tokenize=False)
    got = decoder.encode_chat([*USER, message, result], tools=TOOLS)[0]
    assert decoder.tokenizer.decode(got) == want and '"city": "Paris"' in want
    assert isinstance(message["tool_calls"][0]["function"]["arguments"], str)  # the message is not changed


@pytest.mark.parametrize("given, error", [
    ({"tool_call_parser": "xml"}, "tool_call_parser 'xml' is not known; the parsers are: hermes, qwen3_coder, "
                                  "llama3_json, pythonic"),
    ({"reasoning_parser": "o1"}, "reasoning_parser 'o1' is not known; the parsers are: qwen3, deepseek_r1"),
])
def test_unknown_parsers_are_named_before_generating(decoder, monkeypatch, given, error):
    monkeypatch.setattr(decoder, "generate", lambda *a, **k: pytest.fail("generated before the parsers were checked"))
    with pytest.raises(ValueError, match=error):
        decoder.chat(USER, **given)


def test_a_target_whose_text_drops_the_tags_is_refused(decoder, monkeypatch):
    monkeypatch.setattr(type(decoder.tokenizer), "all_special_tokens", property(lambda self: ["<think>", "</think>"]))
    with pytest.raises(ValueError, match="marks <think> / </think> as special tokens.*reasoning_parser qwen3"):
        decoder.chat(USER, reasoning_parser="qwen3")


def streaming(monkeypatch, text: str):
    """Every Decoder streams `text` in pieces of 3 characters."""
    def stream(self, prompt=None, *, input_ids=None, stats=None, **_):
        yield from (text[i:i + 3] for i in range(0, len(text), 3))

    monkeypatch.setattr(Decoder, "stream", stream)


def test_cli_generate_parses_chat_replies(tool_target, tmp_path, capsys, monkeypatch):
    base = ["generate", "--set", f"target.path={tool_target}", "--max-new-tokens", str(NEW), "--chat", "Weather?"]
    assert cli.main([*base, "--json"]) == 0  # the real reply: its message is its text
    got = json.loads(capsys.readouterr().out)
    assert got["messages"] == [{"role": "assistant", "content": got["texts"][0]}]
    assert cli.main([*base, "--json", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]) == 0
    assert json.loads(capsys.readouterr().out)["messages"][0]["reasoning_content"] is None
    streaming(monkeypatch, THOUGHT + "Paris.")
    assert cli.main([*base, "--reasoning-parser", "qwen3"]) == 0  # one prompt: streamed, parts apart
    assert capsys.readouterr().out.startswith("[reasoning]\nThe user wants the weather.\n[answer]\nParis.\n")
    assert cli.main(base) == 0  # no parser: the text as it is
    assert capsys.readouterr().out.startswith(THOUGHT + "Paris.\n[stats]")


@pytest.mark.parametrize("flag, value", [("--tool-call-parser", "hermes"), ("--reasoning-parser", "qwen3")])
def test_cli_parsers_go_with_chat_prompts(flag, value, capsys):
    assert cli.main(["generate", "--set", "target.path=/no/such/model", "--prompt", "a", flag, value]) == 2
    assert f"{flag} parses chat replies: it goes with --chat or --messages" in capsys.readouterr().err


def test_terminal_chat_sets_the_thought_apart(decoder, monkeypatch, capsys):
    streaming(monkeypatch, THOUGHT + "Paris.")
    end = converse(decoder, io.StringIO("Weather?\n"), [], reasoning_parser="qwen3", show_stats=False)
    assert capsys.readouterr().out == "[reasoning]\nThe user wants the weather.\n[answer]\nParis.\n"
    assert end[-1] == {"role": "assistant", "reasoning_content": "\nThe user wants the weather.\n",
                       "content": "\n\nParis."}
    converse(decoder, io.StringIO("Weather?\n"), [], show_stats=False)
    assert capsys.readouterr().out == THOUGHT + "Paris.\n"  # no parser: as before


def test_chat_and_the_cli_read_qwen3_coder_values_by_their_tools(decoder, tool_target, tmp_path, monkeypatch, capsys):
    from test_tool_call_xml import CALLS
    from test_tool_call_xml import REPLY as XML_REPLY
    from test_tool_call_xml import TOOLS as XML_TOOLS

    returning(decoder, monkeypatch, [XML_REPLY])
    assert calls_of(decoder.chat(USER, tools=XML_TOOLS, tool_call_parser="qwen3_coder").messages[0]["tool_calls"]) \
        == CALLS
    monkeypatch.setattr(Decoder, "generate", lambda self, *a, **k: GenerationOutput(
        [XML_REPLY, XML_REPLY], [[1], [1]], GenerationStats(finish_reasons=["eos", "eos"])))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(XML_TOOLS))
    base = ["generate", "--set", f"target.path={tool_target}", "--chat", "a", "--chat", "b", "--tools", str(tools),
            "--tool-call-parser", "qwen3_coder"]
    assert cli.main([*base, "--json"]) == 0
    assert [calls_of(m["tool_calls"]) for m in json.loads(capsys.readouterr().out)["messages"]] == [CALLS, CALLS]
    assert cli.main(base) == 0  # two prompts: each message printed whole
    assert capsys.readouterr().out.count('[tool call] search {"query": "007", "limit": 5,') == 2


# A thinking model's template that opens the thought in the prompt (as Qwen3-Thinking-2507's does):
# its replies start inside the thought and write only </think>.
THINKING_TEMPLATE = TOOL_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                          "<|im_start|>assistant\n<think>\n{% endif %}")
OPENED_REPLY = "The user wants the weather.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def thinking_target(chat_target, tmp_path_factory):
    return with_template(chat_target, tmp_path_factory, "thinking-target", THINKING_TEMPLATE)


def test_opened_thoughts_follow_each_rows_prompt(decoder):
    prompts = [decoder.tokenizer.encode("<|im_start|>assistant\n<think>\n"), decoder.tokenizer.encode("Hi")]
    assert opened_thoughts(decoder.tokenizer, prompts, 4, "qwen3") == [True, True, False, False]  # n = 2
    assert opened_thoughts(decoder.tokenizer, prompts, 4, None) == [False] * 4


def test_a_prompt_that_ended_the_thought_streams_as_its_whole_reply_reads(decoder):
    """Thinking switched off (the template wrote an empty <think></think>): the reply is all answer,
    a "<think>" written inside it too; the stream sent what followed it as reasoning, the whole not."""
    tok = decoder.tokenizer
    ended = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    earlier = tok.encode("<think>\nx\n</think>\n\nok<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # (a closed thought of an earlier turn, which a tool loop's prompt keeps, leaves the new reply free to think)
    assert opened_thoughts(tok, [ended, earlier], 2, "qwen3") == [None, False]
    text = '[{"name": "w", "parameters": {"c": "a<think>b"}}] and <think>more</think> after'
    for tool_parser, parser in (("hermes", "qwen3"), (None, "qwen3"), (None, "deepseek_r1"), ("hermes", "mistral")):
        message, _ = reply_message(text, "length", tool_parser, parser, opened=None)
        assert message["content"] == text and message["reasoning_content"] is None
        for cut in (1, 3, 7):
            stream = ReplyStream(tool_parser, parser, opened=None)
            pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
            deltas = [d for k, piece in enumerate(pieces) for d in stream.feed(piece, final=k == len(pieces) - 1)]
            assert "".join(d.get("content", "") for d in deltas) == text
            assert not any("reasoning_content" in d for d in deltas)


def test_a_reply_to_a_prompt_that_opened_the_thought_is_split_everywhere(thinking_target, monkeypatch, capsys):
    """Decoder.chat, the CLI (whole and streamed) and the terminal chat read the reply as starting
    inside the thought, because the prompt ends in <think>."""
    dec = draftsman.load({"target": {"path": str(thinking_target)}, "drafter": {"name": "ngram", "k": 3}})
    assert decoder_prompt_text(dec).endswith("<|im_start|>assistant\n<think>\n")
    returning(dec, monkeypatch, [OPENED_REPLY])
    assert whole(dec.chat(USER, reasoning_parser="qwen3").messages[0]) == ("The user wants the weather.\n",
                                                                            "Paris.", [])
    monkeypatch.setattr(Decoder, "generate", lambda self, *a, input_ids, **k: GenerationOutput(
        [OPENED_REPLY] * len(input_ids), [[1]] * len(input_ids),
        GenerationStats(finish_reasons=["eos"] * len(input_ids))))
    base = ["generate", "--set", f"target.path={thinking_target}", "--chat", "Weather?", "--reasoning-parser", "qwen3"]
    assert cli.main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["messages"][0]["reasoning_content"] == "The user wants the weather.\n"
    assert cli.main([*base, "--chat", "Time?"]) == 0  # two prompts: each message printed whole
    assert capsys.readouterr().out.count("[reasoning]\nThe user wants the weather.\n[answer]\nParis.\n") == 2
    streaming(monkeypatch, OPENED_REPLY)
    assert cli.main(base) == 0
    assert capsys.readouterr().out.startswith("[reasoning]\nThe user wants the weather.\n[answer]\nParis.\n")
    end = converse(dec, io.StringIO("Weather?\n"), [], reasoning_parser="qwen3", show_stats=False)
    assert capsys.readouterr().out == "[reasoning]\nThe user wants the weather.\n[answer]\nParis.\n"
    assert end[-1]["reasoning_content"] == "The user wants the weather.\n"


def decoder_prompt_text(dec) -> str:
    return dec.tokenizer.decode(dec.encode_chat(USER)[0])


def test_serve_reads_a_reply_to_an_opened_thought(thinking_target, monkeypatch):
    from serving import call, events, ngram_decoder, running
    from test_serve_tool_calls import replying

    with running(ngram_decoder(thinking_target), reasoning_parser="qwen3") as (server, base):
        replying(server, monkeypatch, OPENED_REPLY)
        status, got = call(base, "/v1/chat/completions", {"messages": USER})
        assert status == 200 and whole(got["choices"][0]["message"]) == ("The user wants the weather.\n", "Paris.", [])
        streamed = events(base, "/v1/chat/completions", {"messages": USER, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in streamed]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather.\n"
        assert "".join(d.get("content", "") for d in deltas) == "\n\nParis."
