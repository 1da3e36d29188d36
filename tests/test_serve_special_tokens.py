"""vLLM's "skip_special_tokens": false keeps a request's special tokens in its text (draftsman
serve), but the token that ends a row (EOS unless ignore_eos, its stop_token_ids), as vLLM leaves that out."""
from transformers import AutoTokenizer

from serving import call, ngram_decoder, queue_while_busy, running


def test_skip_special_tokens_false_keeps_them_in_that_requests_text(chat_target):
    tok = AutoTokenizer.from_pretrained(chat_target[0])
    start = tok.convert_tokens_to_ids("<|im_start|>")  # a special token that ends nothing
    decoder = ngram_decoder(chat_target[0])
    assert start not in decoder.engine.eos_token_ids
    writing = {"prompt": "def f", "max_tokens": 2, "logit_bias": {str(start): 100}}
    keeping = {**writing, "skip_special_tokens": False}
    with running(decoder) as (server, base):
        answers = queue_while_busy(server, base, [keeping, writing, {**keeping, "stream": True}])
        (s0, kept), (s1, dropped), (s2, streamed) = answers
        assert (s0, s1, s2) == (200, 200, 200)
        assert kept["choices"][0]["text"] == "<|im_start|>" * 2 and dropped["choices"][0]["text"] == ""
        assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == "<|im_start|>" * 2
        assert kept["draftsman"]["batch_rows"] == dropped["draftsman"]["batch_rows"] == 3  # one batch
        status, got = call(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                           **{k: v for k, v in keeping.items() if k != "prompt"}})
        assert status == 200 and got["choices"][0]["message"]["content"] == "<|im_start|>" * 2
        # What ends a row stays out of the text: EOS, and a stop token id.
        eos = min(decoder.engine.eos_token_ids)
        status, got = call(base, "/v1/completions", {**keeping, "logit_bias": {str(eos): 100}})
        assert status == 200 and got["choices"][0]["text"] == "" and got["choices"][0]["finish_reason"] == "stop"
        # Under ignore_eos EOS ends nothing, so the text shows it (as vLLM's does).
        status, got = call(base, "/v1/completions", {**keeping, "logit_bias": {str(eos): 100}, "ignore_eos": True})
        assert status == 200 and got["choices"][0]["finish_reason"] == "length"
        assert got["choices"][0]["text"] == decoder.tokenizer.convert_ids_to_tokens(eos) * 2
        status, got = call(base, "/v1/completions", {**writing, "logit_bias": {str(eos): 100}, "ignore_eos": True})
        assert status == 200 and got["choices"][0]["text"] == ""  # (skipped as special tokens are by default)
        status, got = call(base, "/v1/completions", {**keeping, "stop_token_ids": [start]})
        assert status == 200 and got["choices"][0]["text"] == "" and got["choices"][0]["finish_reason"] == "stop"
        status, got = call(base, "/v1/completions", {**writing, "skip_special_tokens": "no"})
        assert status == 400 and '"skip_special_tokens" is true or false, got "no"' in got["error"]["message"]
        status, got = call(base, "/v1/completions", {**keeping, "stop_token_ids": 5})  # its own message
        assert status == 400 and "stop_token_ids" in got["error"]["message"]


def test_the_special_tokens_are_those_decoded_text_drops(chat_target):
    """The tokenizer's named special tokens, and tokens added as special without a name (as
    Llama 3's reserved tokens are)."""
    decoder = ngram_decoder(chat_target[0])
    tok = AutoTokenizer.from_pretrained(chat_target[0])
    tok.add_tokens(["[Y]"], special_tokens=True)
    assert "[Y]" not in tok.all_special_tokens
    decoder.tokenizer = tok
    assert set(decoder.special_tokens().values()) == {"<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>", "[Y]"}
    assert all(tok.decode([token], skip_special_tokens=True) == "" for token in decoder.special_tokens())
