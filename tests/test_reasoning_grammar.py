"""Structured output under a reasoning parser (draftsman/replies.py's grammar_after_thought): the
grammar holds the answer, after the thought's "</think>", as vLLM holds it, so a thinking model
still thinks first; a prompt whose template closed the thought already is held from the first token."""
import contextlib
import dataclasses
import io
import json
import re
import shutil

import pytest
from transformers import GenerationConfig

import draftsman
from draftsman import cli
from draftsman.replies import ReplyStream, grammar_after_thought, reply_message
from draftsman.verifier.structured import StructuredOutput
from serving import call, events, ngram_decoder, running
from tiny_models import build_chat_tokenizer, build_model_folder

USER = [{"role": "user", "content": "Which color?"}]
REGEX = {"regex": "(red|green|blue)( and (red|green|blue))*"}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """(decoder, "</think>"'s id): a tiny Qwen2 chat target whose tokenizer holds <think> and
    </think> as tokens of their own (not special: the decoded text keeps them), as Qwen3's does."""
    folder = tmp_path_factory.mktemp("thinking-tokens")
    tok = build_chat_tokenizer(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = with_tools(tok.chat_template)
    build_model_folder(folder, "qwen2", seed=41, tokenizer=tok)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    decoder = ngram_decoder(folder)
    return decoder, tok.convert_tokens_to_ids("</think>")


def with_tools(template: str) -> str:
    """A ChatML template (tests/tiny_models.py's CHATML) that also reads tools, in a system turn (tool_choice needs
    one); without tools it renders as before."""
    return template.replace("{{ bos_token }}", "{{ bos_token }}{% if tools %}<|im_start|>system\n{{ tools | tojson }}"
                                               "<|im_end|>\n{% endif %}", 1)


def test_the_grammar_waits_for_the_thoughts_end_unless_the_prompt_closed_it(thinking, chat_target):
    decoder, end = thinking
    thinking_on = decoder.encode_chat(USER)[0]
    thinking_off = decoder.encode_chat(USER, chat_template_kwargs={"enable_thinking": False})[0]
    assert end not in thinking_on and end in thinking_off
    spec = StructuredOutput.parse(REGEX)
    assert grammar_after_thought(decoder.tokenizer, [thinking_on], REGEX, "qwen3") == \
        dataclasses.replace(spec, after=(end,))
    assert grammar_after_thought(decoder.tokenizer, [thinking_on, thinking_off], REGEX, "deepseek_r1") == \
        [dataclasses.replace(spec, after=(end,)), spec]
    assert grammar_after_thought(decoder.tokenizer, [thinking_on], REGEX, None) == REGEX
    assert grammar_after_thought(decoder.tokenizer, [thinking_on], None, "qwen3") is None
    with pytest.raises(ValueError, match="writes as [0-9]+ tokens, so where the thought ends cannot be told"):
        grammar_after_thought(chat_target[1], [thinking_on], REGEX, "qwen3")  # </think> spelled in pieces


def test_chat_thinks_first_then_answers_under_the_grammar(thinking):
    """With </think> pushed (logit_bias), the reply thinks for one token, then its answer follows
    the grammar: equal to generate with the grammar set to begin after </think>; thinking
    switched off, the grammar holds from the first token (and </think> is never written)."""
    decoder, end = thinking
    args = dict(max_new_tokens=24, structured_output=REGEX, logit_bias={end: 100})
    out = decoder.chat(USER, reasoning_parser="deepseek_r1", **args)  # the reply starts inside the thought
    ids = decoder.encode_chat(USER)
    after = dataclasses.replace(StructuredOutput.parse(REGEX), after=(end,))
    want = decoder.generate(input_ids=ids, max_new_tokens=24, structured_output=after, logit_bias={end: 100})
    assert out.token_ids == want.token_ids and out.token_ids[0][0] == end
    message = out.messages[0]
    assert not message["reasoning_content"] and re.fullmatch(REGEX["regex"], message["content"].strip())
    held = decoder.chat(USER, **args)  # no reasoning parser: held from the first token, </think> forbidden
    assert end not in held.token_ids[0] and re.fullmatch(REGEX["regex"], held.texts[0])
    off = decoder.chat(USER, reasoning_parser="qwen3", chat_template_kwargs={"enable_thinking": False}, **args)
    assert end not in off.token_ids[0] and re.fullmatch(REGEX["regex"], off.messages[0]["content"])


def test_serve_holds_the_answer_after_the_thought(thinking):
    decoder, end = thinking
    with running(decoder, reasoning_parser="deepseek_r1") as (_, base):
        body = {"messages": USER, "max_tokens": 24, "logit_bias": {str(end): 100},
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "c", "schema": {"enum": ["red", "blue"]}}}}
        status, got = call(base, "/v1/chat/completions", body)
        assert status == 200, got
        want = decoder.chat(USER, reasoning_parser="deepseek_r1", max_new_tokens=24, logit_bias={end: 100},
                            structured_output={"json": {"enum": ["red", "blue"]}})
        assert got["choices"][0]["message"] == {**want.messages[0]}
        assert got["choices"][0]["message"]["content"].strip() in ('"red"', '"blue"')


def test_a_thought_end_in_pieces_is_refused_by_serve(chat_target):
    with running(ngram_decoder(chat_target[0]), reasoning_parser="qwen3") as (_, base):
        status, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 4,
                                                          "response_format": {"type": "json_object"}})
        assert status == 400 and "where the thought ends cannot be told" in got["error"]["message"]


def test_the_prompts_last_thought_marker_decides_whether_the_thought_ended(thinking):
    """As vLLM reads it, from the prompt's end: a template that opens <think> after an earlier turn's
    closed thought leaves the thought open, so the grammar waits for the new </think>."""
    decoder, end = thinking
    start = decoder.tokenizer.convert_tokens_to_ids("<think>")
    closed = decoder.encode_chat(USER, chat_template_kwargs={"enable_thinking": False})[0]
    reopened = closed + [start] + decoder.tokenizer.encode("\n", add_special_tokens=False)
    spec = StructuredOutput.parse(REGEX)
    assert grammar_after_thought(decoder.tokenizer, [closed, reopened], REGEX, "qwen3") == \
        [spec, dataclasses.replace(spec, after=(end,))]


def test_every_chat_grammar_waits_for_the_thought(thinking, tmp_path):
    """Per conversation (a list, None in it: none), from the config, and from `draftsman generate
    --chat`: each grammar begins after </think> (pushed here: the reply's first token)."""
    decoder, end = thinking
    spec = StructuredOutput.parse(REGEX)
    on = decoder.encode_chat(USER)[0]
    assert grammar_after_thought(decoder.tokenizer, [on, on], [REGEX, None], "qwen3") == \
        [dataclasses.replace(spec, after=(end,)), None]
    args = dict(max_new_tokens=16, reasoning_parser="deepseek_r1", logit_bias={end: 100})
    listed = decoder.chat([USER, USER], structured_output=[REGEX, REGEX], **args)
    assert [ids[0] for ids in listed.token_ids] == [end, end]
    assert all(re.fullmatch(REGEX["regex"], m["content"].strip()) for m in listed.messages)
    folder = decoder.config["target"]["path"]
    configured = draftsman.load({"target": {"path": folder}, "sampling": {"structured_output": REGEX}})
    assert configured.chat(USER, **args).token_ids == listed.token_ids[:1]
    flags = ["generate", "--set", f"target.path={folder}", "--chat", USER[0]["content"], "--max-new-tokens", "16",
             "--reasoning-parser", "deepseek_r1", "--structured-output", json.dumps(REGEX), "--logit-bias",
             f"{end}=100", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(flags) == 0
    assert json.loads(out.getvalue())["token_ids"] == listed.token_ids[:1]


def test_the_answer_is_what_follows_the_thought_end_the_grammar_began_at(thinking):
    """qwen3: a reply that writes </think> without <think> has its grammar begin there, so its answer
    is what follows (before: the whole text, </think> and all); a forced call is read back."""
    decoder, end = thinking
    args = dict(max_new_tokens=24, reasoning_parser="qwen3", logit_bias={end: 100})
    out = decoder.chat(USER, structured_output=REGEX, **args)
    assert out.texts[0].startswith("</think>")
    assert out.messages[0]["reasoning_content"] is None
    assert re.fullmatch(REGEX["regex"], out.messages[0]["content"].strip())
    empty = {"type": "object", "properties": {}, "additionalProperties": False}  # no key for </think> to fill
    tools = [{"type": "function", "function": {"name": "t", "parameters": empty}}]
    forced = decoder.chat(USER, tools=tools, tool_choice="required", parallel_tool_calls=False,
                          **{**args, "max_new_tokens": 48})
    assert [call["function"]["name"] for call in forced.messages[0]["tool_calls"]] == ["t"]


def test_a_forced_call_under_a_thought_end_in_pieces_names_tool_choice(chat_target, tmp_path):
    """The refusal names what set the grammar: tool_choice, not a structured output never sent
    (chat() and the server alike)."""
    shutil.copytree(chat_target[0], tmp_path, dirs_exist_ok=True)
    tok = chat_target[1]
    tok.chat_template, template = with_tools(tok.chat_template), tok.chat_template
    try:
        tok.save_pretrained(tmp_path)
    finally:
        tok.chat_template = template  # (the session's tokenizer, shared)
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {}}}}]
    decoder = ngram_decoder(tmp_path)
    with pytest.raises(ValueError, match='tool_choice "required" or a named function holds the reply') as caught:
        decoder.chat(USER, tools=tools, tool_choice="required", reasoning_parser="qwen3", max_new_tokens=4)
    assert "structured output" not in str(caught.value)
    with running(decoder, reasoning_parser="qwen3", tool_call_parser="hermes") as (_, base):
        status, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "tools": tools,
                                                          "tool_choice": "required"})
        assert status == 400 and 'tool_choice "required" or a named function' in got["error"]["message"], got



@pytest.mark.parametrize("text", ["</think>yes.", "x<think>y</think>no!", "<think>y</think>\n\nno.", "cut off </thi"])
def test_a_reply_read_from_the_thought_streams_as_it_reads_whole(text):
    """A reply whose grammar began after the thought is read as starting inside it (opened_thoughts):
    streamed in pieces, its deltas join to the whole reply's message, the answer what follows </think>."""
    stream = ReplyStream(None, "qwen3", opened=True)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3])] + stream.feed("", final=True)
    streamed = {key: "".join(d.get(key, "") for d in deltas) or None for key in ("reasoning_content", "content")}
    message = reply_message(text, "stop", None, "qwen3", opened=True)[0]
    assert streamed == {key: message[key] for key in streamed}
    assert message["content"] == (text.split("</think>", 1)[1] if "</think>" in text else None)


def test_serve_reads_the_answer_from_where_the_grammar_began(thinking):
    """The server as chat(): under qwen3, a reply whose grammar began at a bare </think> answers
    with what follows it, whole and streamed; the config's grammar waits for the thought too."""
    decoder, end = thinking
    args = dict(max_new_tokens=24, reasoning_parser="qwen3", logit_bias={end: 100})
    out = decoder.chat(USER, structured_output=REGEX, **args)
    want, tokens = out.messages[0], len(out.token_ids[0])  # </think> first (held from it, no room for it)
    body = {"messages": USER, "max_tokens": 24, "logit_bias": {str(end): 100}, "structured_outputs": REGEX}
    with running(decoder, reasoning_parser="qwen3") as (_, base):
        status, got = call(base, "/v1/chat/completions", body)
        assert status == 200, got
        assert got["choices"][0]["message"] == want and re.fullmatch(REGEX["regex"], want["content"].strip())
        assert got["usage"]["completion_tokens"] == tokens
        deltas = [e["choices"][0]["delta"] for e in events(base, "/v1/chat/completions", {**body, "stream": True})
                  if e.get("choices")]
        assert "".join(d.get("content") or "" for d in deltas) == want["content"]
    folder = decoder.config["target"]["path"]
    configured = draftsman.load({"target": {"path": folder}, "drafter": {"name": "ngram"},
                                 "sampling": {"structured_output": REGEX}})
    with running(configured, reasoning_parser="qwen3") as (_, base):
        status, got = call(base, "/v1/chat/completions", {k: v for k, v in body.items() if k != "structured_outputs"})
        assert status == 200 and got["choices"][0]["message"] == want, got
        assert got["usage"]["completion_tokens"] == tokens and out.token_ids[0][0] == end


def test_a_grammar_that_waits_for_the_thought_is_named_in_words(thinking):
    """A bad grammar's refusal says it begins after the thought, not which token ids it waits for."""
    decoder, _ = thinking
    with pytest.raises(ValueError, match=r"structured_output 'regex \(red \(held after the thought ends\)' does "
                                         r"not compile") as caught:
        decoder.chat(USER, reasoning_parser="qwen3", structured_output={"regex": "(red"}, max_new_tokens=4)
    assert "tokens [" not in str(caught.value)
