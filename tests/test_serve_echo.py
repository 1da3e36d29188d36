"""Prompt scoring: Decoder.prompt_logprobs is the target's own log-probability of each prompt
token (checked against the model's logits and against generate's logprobs of the same tokens),
and the completions endpoint's "echo" writes the prompt and its scores before the completion,
in the shape lm-evaluation-harness's `local-completions` reads for loglikelihood tasks."""
import pytest
import torch

from serving import NEW, call
from tiny_models import load_for_reference


def test_prompt_logprobs_are_the_targets(served):
    decoder, _ = served
    prompt = decoder.encode(["def parse(text):\n    return"])[0]
    values, tops = decoder.prompt_logprobs([prompt, prompt[:4]], top_logprobs=3)
    model = load_for_reference(decoder.config["target"]["path"])
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert values[0][0] is None and tops[0][0] is None and len(values[0]) == len(prompt)
    assert values[0][1:] == pytest.approx([logp[j - 1, prompt[j]].item() for j in range(1, len(prompt))], abs=1e-5)
    assert [t for t, _ in tops[0][3]] == logp[2].topk(3).indices.tolist()
    assert values[1] == pytest.approx(values[0][:4], abs=1e-5)
    # The same tokens scored as a prompt and as generate's output agree.
    out = decoder.generate(input_ids=[prompt], max_new_tokens=NEW, logprobs=True)
    whole, _ = decoder.prompt_logprobs([prompt + out.token_ids[0]])
    assert whole[0][len(prompt):] == pytest.approx(out.logprobs[0], abs=1e-4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        decoder.prompt_logprobs([[]])
    with pytest.raises(ValueError, match="top_logprobs must be a whole number >= 0"):
        decoder.prompt_logprobs([prompt], top_logprobs=-1)


def test_echo_as_lm_eval_harness_asks_for_it(served):
    decoder, base = served
    contexts = [decoder.encode(["def parse(text):\n"])[0], decoder.encode(["import os\nimport"])[0]]
    # lm-eval's local-completions loglikelihood request: token ids, one new token, echo, logprobs 1.
    status, got = call(base, "/v1/completions", {"model": "tiny", "prompt": contexts, "temperature": 0,
                                                  "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200
    values, _ = decoder.prompt_logprobs(contexts)
    want = decoder.generate(input_ids=contexts, max_new_tokens=1, logprobs=True)
    for choice, ctx, prompt_values, new_ids, new_values, new_text in zip(
            got["choices"], contexts, values, want.token_ids, want.logprobs, want.texts):
        scores = choice["logprobs"]
        assert len(scores["tokens"]) == len(ctx) + 1
        assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
        assert scores["token_logprobs"][1:len(ctx)] == pytest.approx(prompt_values[1:], abs=1e-5)
        assert scores["token_logprobs"][-1] == pytest.approx(new_values[0], abs=1e-5)
        assert choice["text"] == decoder.decode(ctx) + new_text
        assert scores["text_offset"][len(ctx)] == len(decoder.decode(ctx))
        # lm-eval's reading: the sum over the continuation, and whether each token was the argmax
        # (greedy: the one new token is its position's likeliest).
        continuation = scores["token_logprobs"][len(ctx):]
        assert continuation[0] == max(scores["top_logprobs"][len(ctx)].values())


def test_echo_with_n_samples_writes_each_rows_own_prompt(served):
    _, base = served
    prompts = ["def parse(text):\n", "import os\nimport"]
    status, got = call(base, "/v1/completions", {"prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 1.0,
                                                  "echo": True})
    assert status == 200 and len(got["choices"]) == 4
    assert [c["text"].startswith(prompts[i // 2]) for i, c in enumerate(got["choices"])] == [True] * 4


def test_echo_with_no_new_tokens_scores_the_prompt(served):
    decoder, base = served
    status, got = call(base, "/v1/completions", {"prompt": "def parse(text):\n", "max_tokens": 0, "echo": True,
                                                  "logprobs": 2})
    assert status == 200
    ids = decoder.encode(["def parse(text):\n"])[0]
    values, tops = decoder.prompt_logprobs([ids], top_logprobs=2)
    choice = got["choices"][0]
    assert choice["text"] == "def parse(text):\n" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(values[0][1:], abs=1e-5)
    assert [len(t) for t in choice["logprobs"]["top_logprobs"][1:]] == [len({decoder.decode_token(i) for i, _ in top})
                                                                         for top in tops[0][1:]]
    assert got["usage"]["completion_tokens"] == 0 and got["usage"]["prompt_tokens"] == len(ids)
    status, got = call(base, "/v1/completions", {"prompt": "def parse(text):\n", "max_tokens": 0, "echo": True})
    assert status == 200 and got["choices"][0]["text"] == "def parse(text):\n" and got["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body, message", [
    ({"echo": "yes"}, '"echo" is true or false'),
    ({"echo": True, "stream": True}, '"echo" is not served with "stream": true'),
    ({"max_tokens": 0}, '"max_tokens" must be a whole number >= 1, got 0'),  # the request's field
    ({"max_tokens": 0, "echo": True, "prompt": [5, 10**9]}, "outside the target's vocabulary"),
])
def test_bad_echo_requests(served, body, message):
    _, base = served
    status, got = call(base, "/v1/completions", {"prompt": "x = [", **body})  # body's prompt wins
    assert status == 400 and message in got["error"]["message"]


def test_echo_offsets_index_the_text_past_special_and_byte_tokens(served):
    """A special token the text leaves out (a BOS) or a character split over byte tokens: the
    offsets counted each token's own piece ("<s>", "\ufffd"), so they ran past the prompt's text
    and the completion's then ran backwards."""
    decoder, base = served
    special = next(iter(decoder.special_tokens()))
    prompt = [special, *decoder.encode(["é = 'naïve'"])[0]]
    assert any(decoder.decode_token(t) == "\ufffd" for t in prompt)  # (the test needs split characters)
    status, got = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0,
                                                  "ignore_eos": True})
    assert status == 200, got
    text, offsets = got["choices"][0]["text"], got["choices"][0]["logprobs"]["text_offset"]
    echoed = decoder.decode(prompt)
    assert text.startswith(echoed) and offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert offsets[:2] == [0, 0]  # the special token takes no room in the text
    for i in range(1, len(prompt)):  # after whole characters: the length of the text before the token
        before = decoder.decode(prompt[:i])
        if not before.endswith("\ufffd"):
            assert offsets[i] == len(before), i
    assert offsets[len(prompt)] == len(echoed)


def test_a_prompt_that_fills_the_context_is_scored(served):
    """lm-eval's loglikelihood at full length: "max_tokens": 0 with echo asks for no room to
    generate, and a prompt of the whole context fits one pass; generating after it is refused."""
    decoder, base = served
    context = decoder.engine.max_context
    prompt = (decoder.encode(["def parse(text):\n    return text\n" * 40])[0] * 4)[:context]
    status, got = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200, got
    values, _ = decoder.prompt_logprobs([prompt])  # the Python API scores it too
    assert got["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(values[0][1:], abs=1e-4)
    with pytest.raises(ValueError, match=f"shorten it to at most {context} tokens"):
        decoder.prompt_logprobs([prompt + [5]])
    for body, message in [({"prompt": prompt, "max_tokens": 1, "echo": True}, "leaving no room to generate"),
                          ({"prompt": prompt + [5], "max_tokens": 0, "echo": True},
                           f"shorten it to at most {context} tokens")]:
        status, got = call(base, "/v1/completions", body)
        assert status == 400 and message in got["error"]["message"], got
