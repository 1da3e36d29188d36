"""Structured output under a reasoning parser (draftsman/replies.py's grammar_after_thought): the
grammar holds the answer, after the thought's "</think>", as vLLM holds it, so a thinking model
still thinks first; a prompt whose template closed the thought already is held from the first token."""
import dataclasses
import re

import pytest
from transformers import GenerationConfig

from draftsman.replies import grammar_after_thought
from draftsman.verifier.structured import StructuredOutput
from serving import call, ngram_decoder, running
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
    build_model_folder(folder, "qwen2", seed=41, tokenizer=tok)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    decoder = ngram_decoder(folder)
    return decoder, tok.convert_tokens_to_ids("</think>")


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
