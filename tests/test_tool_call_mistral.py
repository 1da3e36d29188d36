"""Mistral's tool calls (`--tool-call-parser mistral`, draftsman/tool_call_mistral.py): the reply's
content, then [TOOL_CALLS] and the calls in the tokenizer version's form. [TOOL_CALLS] is a special
token, so under this parser a chat reply's decoded text keeps it (generate's keep_in_text); the replies'
shaping is tested on texts, the keeping on a tiny target whose tokenizer has the markers as special tokens."""
import json
import random
import shutil

import pytest
from transformers import AutoTokenizer

import draftsman
from draftsman.api import JoiningPrompt
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
    'Sure.\n[TOOL_CALLS]get_time{"zone": "CET"}': ("Sure.\n", [("get_time", {"zone": "CET"})]),  # no [ARGS]
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
    content exactly, the calls arrive whole, indexed in order."""
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
        assert (content or None, named(calls)) == CASES[text]
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


def test_a_chat_under_the_mistral_parser_keeps_the_marker_in_its_replies_only(mistral_target, monkeypatch):
    """A reply made to start with [TOOL_CALLS] (a logit bias): under the parser its text holds the
    marker (cut off there: no calls, so all content); without it the text drops it. The marker is
    kept for that call's rows only: the decoder's own setting is never changed, not even while
    chat generates (two threads may chat on one decoder)."""
    folder, tok = mistral_target
    decoder = draftsman.load({"target": {"path": str(folder)}})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    conversation = [{"role": "user", "content": "What time is it?"}]
    settings = {"max_new_tokens": 1, "logit_bias": {marker: 100.0}}
    seen, generate = [], decoder.generate

    def recording(*args, **kwargs):
        seen.append(dict(decoder.kept_in_text))
        return generate(*args, **kwargs)
    monkeypatch.setattr(decoder, "generate", recording)
    out = decoder.chat(conversation, tool_call_parser="mistral", **settings)
    assert out.token_ids == [[marker]] and out.texts == ["[TOOL_CALLS]"]
    assert out.messages[0]["content"] == "[TOOL_CALLS]" and "tool_calls" not in out.messages[0]
    assert seen == [{}] and decoder.kept_in_text == {}
    assert decoder.chat(conversation, **settings).texts == [""]
    assert decoder.generate(input_ids=out.token_ids, **settings).texts == [""]
    # The decoder's own kept tokens stay kept beside the parser's; a call's own list replaces them.
    decoder.keep_in_text(["[THINK]"])
    think = tok.convert_tokens_to_ids("[THINK]")
    both = decoder.chat([conversation, conversation], tool_call_parser="mistral", max_new_tokens=2,
                        logit_bias=[{marker: 100.0}, {think: 100.0}])
    assert both.texts == ["[TOOL_CALLS]" * 2, "[THINK]" * 2]
    writing = {"input_ids": [[5, 6]], "max_new_tokens": 2, "logit_bias": {marker: 100.0}}
    assert decoder.generate(**writing, keep_in_text=[]).texts == [""]
    assert decoder.generate(**writing, keep_in_text=[["[TOOL_CALLS]"]]).texts == ["[TOOL_CALLS]" * 2]
    assert decoder.generate(**{**writing, "logit_bias": {think: 100.0}}).texts == ["[THINK]" * 2]  # the decoder's
    assert decoder.kept_in_text == {think: "[THINK]"}


def test_a_row_stops_on_the_text_it_shows(mistral_target):
    """Stop strings search the text a row keeps its markers in, row by row in one batch."""
    folder, tok = mistral_target
    decoder = draftsman.load({"target": {"path": str(folder)}})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    settings = {"max_new_tokens": 4, "logit_bias": {marker: 100.0}, "stop": ["CALLS]"]}
    out = decoder.generate(input_ids=[[5, 6], [5, 6]], keep_in_text=[["[TOOL_CALLS]"], []], **settings)
    assert out.texts == ["[TOOL_", ""] and out.stats.finish_reasons == ["stop", "length"]
    assert out.token_ids == [[marker], [marker] * 4]
    assert "".join(decoder.stream(input_ids=[5, 6], keep_in_text=["[TOOL_CALLS]"], **settings)) == "[TOOL_"
    held = {**settings, "stop": ["CALLS]!"]}  # the text's end may start a stop: held back, then sent as the row ends
    assert "".join(decoder.stream(input_ids=[5, 6], keep_in_text=["[TOOL_CALLS]"], **held)) == "[TOOL_CALLS]" * 4


def test_a_wrong_keep_in_text_is_refused_with_what_to_give(mistral_target):
    decoder = draftsman.load({"target": {"path": str(mistral_target[0])}})
    with pytest.raises(ValueError, match=r"a list of special tokens' texts, e.g. \['\[TOOL_CALLS\]'\]"):
        decoder.generate(input_ids=[[5, 6]], max_new_tokens=1, keep_in_text="[TOOL_CALLS]")
    with pytest.raises(ValueError, match="keep_in_text has 2 lists for 1 prompts: give one list, or one per prompt"):
        decoder.generate(input_ids=[[5, 6]], max_new_tokens=1, keep_in_text=[["[ARGS]"], []])


def test_rows_that_join_a_batch_keep_their_own_markers(mistral_target):
    """stream_batch: a joining row's keep_in_text is its own, None taking the batch's; its stop
    strings search that text."""
    from serving import ngram_decoder

    folder, tok = mistral_target
    decoder = ngram_decoder(folder)
    marker, text = tok.convert_tokens_to_ids("[TOOL_CALLS]"), "[TOOL_CALLS]" * 3
    pending = [[JoiningPrompt([5, 6]), JoiningPrompt([5, 6], keep_in_text=[]),
                JoiningPrompt([5, 6], stop=["CALLS]"], keep_in_text=["[TOOL_CALLS]"])]]
    shown, early, tokens, reasons = {}, {}, {}, {}
    joining = lambda: pending.pop() if pending else []  # noqa: E731
    for row, chunk in decoder.stream_batch([[5, 6]], keep_in_text=["[TOOL_CALLS]"], max_new_tokens=3,
                                           logit_bias={marker: 100.0}, joining=joining):
        shown[row] = shown.get(row, "") + chunk.text
        early[row] = early.get(row, "") + (chunk.text if chunk.finish_reason is None else "")
        tokens[row] = tokens.get(row, 0) + len(chunk.token_ids)
        reasons[row] = chunk.finish_reason or reasons.get(row)
    assert shown == {0: text, 1: text, 2: "", 3: "[TOOL_"}
    assert early == shown  # each round's text as it comes, none held to the row's end
    assert tokens == {0: 3, 1: 3, 2: 3, 3: 1} and reasons == {0: "length", 1: "length", 2: "length", 3: "stop"}


def test_a_request_that_joins_a_served_batch_keeps_the_decoders_markers(mistral_target):
    """The batcher: a request that names no kept tokens joins a batch whose row keeps the markers,
    and its text keeps the decoder's (none), not the batch's."""
    import threading

    from draftsman.serve_batch import Batcher
    from serving import ngram_decoder
    from test_continuous_batching import hold_until_joined

    folder, tok = mistral_target
    decoder = ngram_decoder(folder)
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    bias = {"logit_bias": {marker: 100.0}}
    job, chunks = batcher.stream([[5, 6]], {"max_new_tokens": 40, "keep_in_text": ["[TOOL_CALLS]"], **bias})
    first = next(chunks)[1]
    hold_until_joined(batcher, decoder, job)
    out, rows = batcher.generate([[5, 6]], {"max_new_tokens": 3, **bias})
    assert rows == 2 and out.texts == [""] and out.token_ids == [[marker] * 3]
    assert first.text.startswith("[TOOL_CALLS]")  # sent as it comes
    assert first.text + "".join(chunk.text for _, chunk in chunks) == "[TOOL_CALLS]" * 40


def test_the_server_keeps_the_markers_in_chat_replies_only(mistral_target, tmp_path):
    """vLLM keeps Mistral's tool-call markers for a chat request with tools, and the reasoning
    parser's tags for chat requests: requests of every kind, each made to write [TOOL_CALLS] or
    [THINK], share one batch, and only the chat replies the parsers read show them."""
    from serving import ngram_decoder, queue_while_busy, running
    from test_serve_tool_calls import TOOL_TEMPLATE, TOOLS, USER

    shutil.copytree(mistral_target[0], tmp_path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = TOOL_TEMPLATE  # one that reads tools
    tokenizer.save_pretrained(tmp_path)
    calls, think = (tokenizer.convert_tokens_to_ids(marker) for marker in ("[TOOL_CALLS]", "[THINK]"))
    chat, completion = {"messages": USER, "max_tokens": 2}, {"prompt": "Weather in Paris?", "max_tokens": 2}
    writing_calls, thinking = {"logit_bias": {str(calls): 100}}, {"logit_bias": {str(think): 100}}
    requests = [  # (endpoint, body, (reasoning, content) of a chat reply or a completion's text)
        ("chat", {**chat, **writing_calls, "tools": TOOLS}, (None, "[TOOL_CALLS]" * 2)),
        ("completions", {**completion, **writing_calls}, ""),
        ("chat", {**chat, **writing_calls}, (None, None)),  # no tools: no calls to read (no text: no content)
        ("chat", {**chat, **writing_calls, "tools": TOOLS, "tool_choice": "none"}, (None, None)),
        ("chat", {**chat, **writing_calls, "tools": TOOLS, "stream": True}, (None, "[TOOL_CALLS]" * 2)),
        ("completions", {**completion, **writing_calls, "stream": True}, ""),
        ("chat", {**chat, **thinking}, ("[THINK]", None)),  # a thought opened twice, not closed
        ("completions", {**completion, **thinking}, "")]
    with running(ngram_decoder(tmp_path), tool_call_parser="mistral", reasoning_parser="mistral") as (server, base):
        answers = queue_while_busy(server, base, [body for _, body, _ in requests],
                                   [f"/v1/{kind}" if kind == "completions" else "/v1/chat/completions"
                                    for kind, _, _ in requests])
        assert server.decoder.kept_in_text == {}
    for (kind, body, want), (status, got) in zip(requests, answers):
        assert status == 200, got
        if body.get("stream"):
            parts = [e["choices"][0].get("delta", e["choices"][0]) for e in got if e["choices"]]
            joined = {key: "".join(p.get(key) or "" for p in parts) for key in ("reasoning_content", "content", "text")}
            reply = ((joined["reasoning_content"] or None, joined["content"]) if kind == "chat" else joined["text"])
            stats = got[-1]["draftsman"]
        else:
            choice = got["choices"][0]
            reply = ((choice["message"].get("reasoning_content"), choice["message"]["content"]) if kind == "chat"
                     else choice["text"])
            stats = got["draftsman"]
        assert reply == want, (kind, body)
        assert stats["batch_rows"] == len(requests)  # all in one batch


def test_the_server_answers_a_mistral_reply_with_its_content_and_calls(mistral_target, monkeypatch, tmp_path):
    from serving import call, events, ngram_decoder, running
    from test_serve_tool_calls import TOOL_TEMPLATE, TOOLS, USER, replying

    shutil.copytree(mistral_target[0], tmp_path, dirs_exist_ok=True)
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


def test_a_tokenizer_without_the_markers_is_refused_with_the_fix(chat_target, mistral_target):
    """A target whose tokenizer has no [TOOL_CALLS] (or [THINK] / [/THINK]) does not write
    Mistral's format: the parser would find nothing, so it is refused up front, as vLLM's is."""
    from draftsman.replies import check_parsers

    tok = AutoTokenizer.from_pretrained(chat_target[0])
    with pytest.raises(ValueError, match=r"no \[TOOL_CALLS\] token, .* leave out --tool-call-parser"):
        check_parsers(tok, "mistral", None, ("--tool-call-parser", "--reasoning-parser"))
    with pytest.raises(ValueError, match=r"no \[THINK\] / \[/THINK\] token, .* leave out reasoning_parser"):
        check_parsers(tok, None, "mistral")
    decoder = draftsman.load({"target": {"path": str(chat_target[0])}})
    with pytest.raises(ValueError, match=r"no \[TOOL_CALLS\] token"):
        decoder.chat([{"role": "user", "content": "Hi"}], tool_call_parser="mistral", max_new_tokens=2)
    check_parsers(mistral_target[1], "mistral", "mistral")  # its tokenizer has them
    check_parsers(tok, "hermes", "qwen3")  # formats of plain-text tags need no such token
