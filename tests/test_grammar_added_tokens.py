"""A grammar whose text holds an added token's text (verifier/grammar.py's GrammarCompiler): Qwen's
tokenizers add <think>, <tool_call> and the like as tokens that decoded text keeps (special false),
so the grammar writes them as those tokens, and reads them back, as text; special tokens stay special."""
import json
import re

import pytest
from transformers import GenerationConfig

import draftsman
from draftsman.verifier.grammar import GrammarCompiler
from tiny_models import build_chat_tokenizer, build_model_folder

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
USER = [{"role": "user", "content": "Hi"}]
GRAMMARS = [  # (structured output, whether a text fits it)
    ({"choice": ["<tool_call>", "<tool_call>x"]}, lambda text: text in ("<tool_call>", "<tool_call>x")),
    ({"regex": re.escape('Sure.\n<tool_call>\n{"name": "u"}\n</tool_call>')},
     lambda text: text == 'Sure.\n<tool_call>\n{"name": "u"}\n</tool_call>'),
    ({"json": {"type": "object", "properties": {"tag": {"enum": ["<think>", "</think>"]}}, "required": ["tag"]},
      "disable_any_whitespace": True}, lambda text: json.loads(text)["tag"] in ("<think>", "</think>")),
    ({"regex": "(<think>|zz)[a-z]{0,3}"}, lambda text: re.fullmatch("(<think>|zz)[a-z]{0,3}", text)),
]


@pytest.fixture(scope="module")
def added_tokens_target(tmp_path_factory):
    """(target decoder without a drafter, draft model folder): a tiny Qwen2 chat target whose
    tokenizer has ADDED as added tokens, not special, as Qwen2.5/Qwen3's has them."""
    folder = tmp_path_factory.mktemp("added-tokens-target")
    tok = build_chat_tokenizer(folder)
    tok.add_tokens(ADDED)
    build_model_folder(folder, "qwen2", seed=5, tokenizer=tok)
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_of_turn],
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    draft = build_model_folder(tmp_path_factory.mktemp("added-tokens-draft"), "qwen2", seed=6, size="draft",
                               tokenizer=tok)
    return draftsman.load({"target": {"path": str(folder)}}), draft


def test_added_text_tokens_are_text_to_the_grammar_and_specials_stay_special(added_tokens_target):
    decoder, _ = added_tokens_target
    tok = decoder.tokenizer
    llg = GrammarCompiler(tok, len(tok) + 8, [tok.eos_token_id]).tokenizer()
    added = tok.convert_tokens_to_ids(ADDED)
    assert not any(llg.is_special_token(i) for i in added)
    assert llg.decode_bytes(added) == "".join(ADDED).encode()
    assert all(llg.is_special_token(i) for i in tok.all_special_ids)
    assert llg.vocab_size == len(tok) + 8 and llg.eos_tokens == [tok.eos_token_id]


@pytest.mark.parametrize("grammar, fits", GRAMMARS, ids=["choice", "regex", "json_enum", "regex_alternative"])
def test_a_grammar_writes_added_tokens_alike_with_every_drafter(added_tokens_target, grammar, fits):
    """Greedy under the grammar: the output fits it, and every drafter's tokens equal plain
    decoding's (before: the matcher refused the added token its own mask allowed, a RuntimeError,
    or the grammar spelled the text out in pieces)."""
    decoder, draft = added_tokens_target
    think = decoder.tokenizer.convert_tokens_to_ids("<think>")
    args = dict(max_new_tokens=40, structured_output=grammar, logit_bias={think: 5.0})
    plain = decoder.chat(USER, **args)
    assert fits(plain.texts[0]), plain.texts
    assert set(decoder.tokenizer.convert_tokens_to_ids(ADDED)) & set(plain.token_ids[0])  # written as the token
    for drafter in ({"name": "ngram", "k": 3, "min_ngram": 1}, {"name": "draft_model", "path": str(draft), "k": 3}):
        assert decoder.with_drafter(drafter).chat(USER, **args).token_ids == plain.token_ids, drafter
