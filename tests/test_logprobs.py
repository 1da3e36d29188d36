"""generate(logprobs=True): the target's log-probability of each new token, and with
top_logprobs=N its N most likely tokens at each position, read from the verification passes
(verifier/logprobs.py). Whatever the drafter, tree and batch, each value must
be what the target gives that token after the row's prompt and earlier tokens: checked against the
target run over the whole sequence at once (teacher forcing) and against Hugging Face
`generate(output_logits=True)`. Broken variants this catches: reading the logits one slot off, the
logits after penalties or the EOS mask, and values not cut where a row ends."""
import re

import pytest
import torch

import draftsman

from tiny_models import load_for_reference, perturbed_copy

NEW = 24
PROMPT_TEXTS = ["def parse(", "class Foo:\n    def", "import"]
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # long n-gram matches: deep accepted paths
SETTINGS = {
    "greedy": {},
    "sampled": {"temperature": 1.0, "seed": 3},
    # None of these change the values: they are the model's own distribution.
    "processed": {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                  "seed": 4, "min_new_tokens": NEW},
}


@pytest.fixture(scope="module")
def close_drafts(tiny_models, tmp_path_factory):
    return {arch: perturbed_copy(t, tmp_path_factory.mktemp(f"{arch}-lp-close"), noise=0.05)
            for arch, (t, _) in tiny_models.items()}


def drafters(arch, close_drafts):
    close = str(close_drafts[arch])
    return {
        "none": {"name": "none"},
        "ngram_tree": {"name": "ngram", "k": 3, "branches": 3, "min_ngram": 1, "max_ngram": 2},
        "draft_model_chain": {"name": "draft_model", "path": close, "k": 5},
        "draft_model_tree": {"name": "draft_model", "path": close, "k": 4, "top_k": 3, "total_tokens": 8},
    }


TOP = 5


def teacher_forced(model, prompt: list[int], tokens: list[int]):
    """log p(token j | prompt, tokens[:j]) from one pass of the target over the whole sequence,
    and the TOP most likely tokens at each position."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], logp.topk(TOP, dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_logprobs_are_the_targets_own_for_every_drafter_and_setting(arch, tiny_models, tiny_tokenizer, close_drafts):
    target = tiny_models[arch][0]
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS] + [REPETITIVE]
    base = draftsman.load({"target": {"path": str(target)}})
    for name, drafter in drafters(arch, close_drafts).items():
        decoder = base.with_drafter(drafter)
        for setting, kwargs in SETTINGS.items():
            out = decoder.generate(input_ids=prompts, max_new_tokens=NEW, logprobs=True, top_logprobs=TOP, **kwargs)
            where = f"{arch} {name} {setting}"
            if name.startswith("draft_model"):  # paths several tokens deep, so node slots are read
                assert out.stats.tau > 1.5, (where, out.stats.tau)
            for prompt, tokens, values, top in zip(prompts, out.token_ids, out.logprobs, out.top_logprobs):
                assert len(values) == len(tokens) == len(top) > 0, where
                want, want_top = teacher_forced(model, prompt, tokens)
                assert torch.allclose(torch.tensor(values), want, atol=1e-4), (where, values, want.tolist())
                assert [[t for t, _ in pos] for pos in top] == want_top.indices.tolist(), where
                assert torch.allclose(torch.tensor([[lp for _, lp in pos] for pos in top]), want_top.values, atol=1e-4)


def test_logprobs_equal_hugging_face_output_logits(tiny_models, tiny_tokenizer, close_drafts):
    target = tiny_models["llama"][0]
    model = load_for_reference(target)
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": drafters("llama", close_drafts)[
        "draft_model_tree"]})
    for text in PROMPT_TEXTS:
        prompt = tiny_tokenizer(text)["input_ids"]
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        tokens = ref.sequences[0, len(prompt):]
        want = torch.stack(ref.logits)[:, 0].log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        out = decoder.generate(input_ids=[prompt], max_new_tokens=NEW, logprobs=True)
        assert out.token_ids[0] == tokens.tolist()
        assert torch.allclose(torch.tensor(out.logprobs[0]), want, atol=1e-4)


def test_logprobs_end_where_the_row_ends(tiny_models, tiny_tokenizer, close_drafts):
    """A stop string inside a round cuts the tokens and their values alike; a row that ends early
    leaves the batch without shifting the others' values."""
    target = tiny_models["qwen2"][0]
    decoder = draftsman.load({"target": {"path": str(target)}, "drafter": drafters("qwen2", close_drafts)[
        "draft_model_chain"]})
    full = decoder.generate(PROMPT_TEXTS, max_new_tokens=NEW, logprobs=True)
    # A stop string that first appears at token p, where p is not the last token of its round.
    ends, total = set(), 0
    for accepted in full.stats.accepted_per_round[0]:
        total += accepted + 1
        ends.add(total)
    row = full.token_ids[0]
    texts = [decoder.decode(row[: p + 1]) for p in range(len(row))]
    stop, p = next((texts[p][-2:], p) for p in range(1, len(row) - 1)
                   if p + 1 not in ends and texts[p][-2:].strip() and texts[p][-2:] not in texts[p - 1])
    cut = decoder.generate(PROMPT_TEXTS, max_new_tokens=NEW, logprobs=True, stop=[stop])
    assert cut.stats.finish_reasons[0] == "stop" and len(cut.token_ids[0]) == p + 1
    for tokens, values, whole in zip(cut.token_ids, cut.logprobs, full.logprobs):
        assert len(values) == len(tokens)  # later rounds run a smaller batch: equal up to rounding
        assert torch.allclose(torch.tensor(values), torch.tensor(whole[: len(values)]), atol=1e-5)
    assert decoder.generate(PROMPT_TEXTS, max_new_tokens=4).logprobs is None  # not asked for


def test_top_logprobs_stop_at_the_vocabulary(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    out = decoder.generate(input_ids=[[5, 6]], max_new_tokens=2, logprobs=True, top_logprobs=10_000)
    assert [len(pos) for pos in out.top_logprobs[0]] == [decoder.engine.vocab_size] * 2
    assert out.top_logprobs[0][0][0] == (out.token_ids[0][0], out.logprobs[0][0])  # greedy: the top one


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": "yes"}, "logprobs must be True or False, got 'yes'"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be a whole number >= 0, got -1"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs must be a whole number >= 0, got 2.5"),
    ({"top_logprobs": 3}, "top_logprobs=3 needs logprobs=True: pass both"),
])
def test_bad_logprobs_arguments_are_refused(tiny_models, kwargs, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=re.escape(message)):
        decoder.generate(input_ids=[[5, 6]], max_new_tokens=2, **kwargs)
