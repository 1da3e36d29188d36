"""Mistral's tool calls (`--tool-call-parser mistral`, draftsman/tool_call_mistral.py): the reply's
content, then [TOOL_CALLS] and the calls in the tokenizer version's form. [TOOL_CALLS] is a special
token, so under this parser decoded text keeps it (Decoder.keep_in_text); the replies' shaping is
tested on texts, the keeping on a tiny target whose tokenizer has the markers as special tokens."""
import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

import draftsman
from draftsman.tool_calls import KEPT_IN_TEXT, parse_tool_calls, tool_call_stream
from tiny_models import build_chat_tokenizer, build_model_folder

WEATHER = {"city": "Paris", "unit": "C"}
CASES = {  # a reply -> (its content, its calls), or None when it is all content
    'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": %s}, {"name": "get_time", "arguments": {}}]'
    % json.dumps(WEATHER): ("Checking.", [("get_weather", WEATHER), ("get_time", {})]),  # before v11
    '[TOOL_CALLS] [{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}]':  # arguments as a string
        (None, [("get_time", {"zone": "CET"})]),
    '[TOOL_CALLS]get_weather[ARGS]%s[TOOL_CALLS]get_time[ARGS]{}' % json.dumps(WEATHER):
        (None, [("get_weather", WEATHER), ("get_time", {})]),  # v11 on
    'Sure.\n[TOOL_CALLS]get_time{"zone": "CET"}': ("Sure.", [("get_time", {"zone": "CET"})]),  # no [ARGS]
    '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}': (None, [("get_time", {})]),  # v13: the id read past
    "No calls here.": None,
    "[TOOL_CALLS]": None,  # cut off at the marker
    "[TOOL_CALLS]get_time[ARGS]{": None,  # cut off in the arguments
    '[TOOL_CALLS][{"name": "get_time", "arguments": {}}': None,  # an unclosed list
    '[TOOL_CALLS]get_time[ARGS]{} and some text': None,  # not only calls after the marker
    '[TOOL_CALLS]get the time[ARGS]{}': None,  # no name
    '[TOOL_CALLS][{"arguments": {}}]': None,  # no name
    '[TOOL_CALLS]get_time[ARGS][1, 2]': None,  # arguments not an object
}


def named(calls):
    for call in calls:  # ids Mistral's templates take back: 9 letters and digits
        assert call["type"] == "function" and len(call["id"]) == 9 and call["id"].isalnum()
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text", CASES)
def test_a_reply_is_its_content_and_its_calls(text):
    content, calls = parse_tool_calls(text, "mistral")
    if CASES[text] is None:
        assert (content, calls) == (text, [])
    else:
        assert (content, named(calls)) == CASES[text]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text", CASES)
def test_a_streamed_reply_gives_what_the_whole_reply_gives(text, seed):
    """Cut at random (inside the markers too): the content deltas join to the whole reply's
    content (as sent, before the whole reply's strip), the calls arrive whole, indexed in order."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    stream, deltas = tool_call_stream("mistral"), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[a:b])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    if CASES[text] is None:
        assert content == text and not calls
    else:
        assert (content.strip() or None, named(calls)) == CASES[text]
        assert [c["index"] for c in calls] == list(range(len(calls))) and stream.calls == len(calls)


def test_content_is_sent_before_the_marker_comes():
    stream = tool_call_stream("mistral")
    assert stream.feed("Let me ") == [{"content": "Let me "}]
    assert stream.feed("check.[TOOL_") == [{"content": "check."}]  # the rest may be the marker: held
    assert stream.feed("CALLS]get_time[ARGS]{}") == []  # calls: held to the end
    assert named([d["tool_calls"][0] for d in stream.finish()]) == [("get_time", {})]


@pytest.fixture(scope="module")
def mistral_target(tmp_path_factory):
    """A tiny chat target whose tokenizer has [TOOL_CALLS], [ARGS], [THINK] and [/THINK] as special
    tokens (as Mistral's tokenizers have them), and no [CALL_ID]."""
    folder = tmp_path_factory.mktemp("mistral-target")
    tok = build_chat_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "[TOOL_CALLS]", "[ARGS]",
                                                          "[THINK]", "[/THINK]"]})
    build_model_folder(folder, "qwen2", seed=3, tokenizer=tok)
    return folder, AutoTokenizer.from_pretrained(folder)


def test_decoded_text_keeps_the_markers_it_is_asked_to(mistral_target):
    folder, tok = mistral_target
    decoder = draftsman.load({"target": {"path": str(folder)}})
    calls, args = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    name, arguments = tok("get_time", add_special_tokens=False)["input_ids"], tok("{}")["input_ids"][1:]
    ids = [*tok("Sure.", add_special_tokens=False)["input_ids"], calls, *name, args, *arguments, tok.eos_token_id]
    assert decoder.decode(ids) == "Sure.get_time{}"  # special tokens dropped, as decoded text has them
    kept = decoder.keep_in_text(KEPT_IN_TEXT["mistral"])
    assert kept == {calls: "[TOOL_CALLS]", args: "[ARGS]"}  # [CALL_ID]: no token of this tokenizer
    assert decoder.decode(ids) == "Sure.[TOOL_CALLS]get_time[ARGS]{}"  # EOS still dropped
    assert parse_tool_calls(decoder.decode(ids), "mistral")[0] == "Sure."
    assert decoder.with_drafter({"name": "ngram"}).decode(ids) == decoder.decode(ids)
    plain = tok.convert_ids_to_tokens(ids[0])  # a token, not a special one: decoded text has it already
    assert decoder.keep_in_text(["<|im_end|>", plain]) == {tok.convert_tokens_to_ids("<|im_end|>"): "<|im_end|>"}
    decoder.keep_in_text(())
    assert decoder.decode(ids) == "Sure.get_time{}"


def test_a_chat_under_the_mistral_parser_keeps_the_marker_in_its_replies_only(mistral_target, tmp_path):
    """A reply made to start with [TOOL_CALLS] (a logit bias): under the parser its text holds the
    marker (cut off there: no calls, so all content); without it, and after the call, the text
    drops it; the server keeps the markers for all its replies."""
    from draftsman.serve import Server

    folder, tok = mistral_target
    decoder = draftsman.load({"target": {"path": str(folder)}})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    conversation = [{"role": "user", "content": "What time is it?"}]
    settings = {"max_new_tokens": 1, "logit_bias": {marker: 100.0}}
    out = decoder.chat(conversation, tool_call_parser="mistral", **settings)
    assert out.token_ids == [[marker]] and out.texts == ["[TOOL_CALLS]"]
    assert out.messages[0]["content"] == "[TOOL_CALLS]" and "tool_calls" not in out.messages[0]
    assert decoder.kept_in_text == {} and decoder.chat(conversation, **settings).texts == [""]
    server = Server(decoder, "tiny", "127.0.0.1", 0, quiet=True, tool_call_parser="mistral")
    try:
        assert decoder.kept_in_text[marker] == "[TOOL_CALLS]"
        assert decoder.generate(input_ids=out.token_ids, **settings).texts == ["[TOOL_CALLS]"]
    finally:
        server.server_close()


def test_the_server_answers_a_mistral_reply_with_its_content_and_calls(chat_target, monkeypatch, tmp_path):
    from serving import call, events, ngram_decoder, running
    from test_serve_tool_calls import TOOL_TEMPLATE, TOOLS, USER, replying

    shutil.copytree(chat_target[0], tmp_path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = TOOL_TEMPLATE  # one that reads tools
    tokenizer.save_pretrained(tmp_path)
    reply = next(text for text, parsed in CASES.items() if parsed and parsed[0] and len(parsed[1]) == 2)
    want_content, want_calls = CASES[reply]
    with running(ngram_decoder(tmp_path), tool_call_parser="mistral") as (server, base):
        replying(server, monkeypatch, reply, reason="stop")
        status, got = call(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
        assert status == 200, got
        choice = got["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == want_content and named(choice["message"]["tool_calls"]) == want_calls
        streamed = events(base, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in streamed]
        assert "".join(d.get("content") or "" for d in deltas) == want_content
        assert named([d["tool_calls"][0] for d in deltas if "tool_calls" in d]) == want_calls
        assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_magistrals_thought_tags_are_kept_under_the_mistral_reasoning_parser(mistral_target):
    """--reasoning-parser mistral keeps [THINK] and [/THINK] in decoded text (with the tool-call
    parser's markers when both are mistral); a reply forced to open a thought is reasoning, not
    the empty text it decodes to without the parser; a grammar begins after [/THINK]."""
    from draftsman.replies import grammar_after_thought, kept_in_text, opened_thoughts

    folder, tok = mistral_target
    decoder = draftsman.load({"target": {"path": str(folder)}})
    think, end = tok.convert_tokens_to_ids(["[THINK]", "[/THINK]"])
    assert set(decoder.keep_in_text(kept_in_text("mistral", "mistral")).values()) == \
        {"[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"}
    assert set(decoder.keep_in_text(kept_in_text(None, "mistral")).values()) == {"[THINK]", "[/THINK]"}
    decoder.keep_in_text(())
    conversation = [{"role": "user", "content": "Why?"}]
    settings = {"max_new_tokens": 3, "logit_bias": {think: 100.0}}
    out = decoder.chat(conversation, reasoning_parser="mistral", **settings)
    assert out.texts == ["[THINK]" * 3] and out.messages[0]["reasoning_content"] == "[THINK]" * 2
    assert out.messages[0]["content"] is None
    assert decoder.chat(conversation, **settings).texts == [""]
    prompt = decoder.encode_chat(conversation)[0]
    assert opened_thoughts(tok, [prompt + [think]], 1, "mistral") == [True]  # a template that opens the thought
    assert opened_thoughts(tok, [prompt], 1, "mistral") == [False]
    spec = grammar_after_thought(tok, [[1, 2]], {"regex": "[a-z]+"}, "mistral")
    assert spec.after == (end,)  # held from the token after the thought


@pytest.mark.parametrize("command, flag", [("chat", "--reasoning-parser"), ("generate", "--tool-call-parser")])
def test_the_commands_keep_the_parsers_markers(mistral_target, monkeypatch, command, flag):
    """`draftsman chat --reasoning-parser mistral` and `generate --chat ... --tool-call-parser
    mistral` decode with the format's markers kept (seen by the decoder they run)."""
    import draftsman.cli as cli_module
    import draftsman.interactive as interactive
    from draftsman import cli

    folder, tok = mistral_target
    seen = []

    def record(decoder, *args, **kwargs):
        seen.append(set(decoder.kept_in_text.values()))
        raise SystemExit(0)
    monkeypatch.setattr(interactive, "converse", record)
    monkeypatch.setattr(cli_module, "_stream_one", record)
    args = [command, "--set", f"target.path={folder}", flag, "mistral"]
    with pytest.raises(SystemExit):
        cli.main(args + (["--chat", "Why?", "--max-new-tokens", "2"] if command == "generate" else []))
    assert seen == [{"[THINK]", "[/THINK]"} if command == "chat" else {"[TOOL_CALLS]", "[ARGS]"}]
