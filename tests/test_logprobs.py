"""generate(logprobs=True): the target's log-probability of each new token, and with
top_logprobs=N its N most likely tokens at each position, read from the verification passes
(verifier/logprobs.py). Whatever the drafter, tree and batch, each value must
be what the target gives that token after the row's prompt and earlier tokens: checked against the
target run over the whole sequence at once (teacher forcing) and against Hugging Face
`generate(output_logits=True)`. Broken variants this catches: reading the logits one slot off, the
logits after penalties or the EOS mask, and values not cut where a row ends."""
import json
import re

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import draftsman
from draftsman import cli

from tiny_models import load_for_reference, perturbed_copy

NEW = 24
PROMPT_TEXTS = ["def parse(", "class Foo:\n    def", "import"]
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # long n-gram matches: deep accepted paths
# (mode, generate arguments). The settings change "processed" values, never "raw" ones.
# Tokens 2 and 4 are in REPETITIVE: the bias and the repetition penalty both touch them there.
PROCESSING = {"logit_bias": {2: 2.0, 4: -3.0}, "repetition_penalty": 1.3, "presence_penalty": 0.5,
              "min_new_tokens": NEW}
SETTINGS = {
    "greedy": ("raw", {}),
    "sampled": ("raw", {"temperature": 1.0, "seed": 3}),
    "raw_under_processing": ("raw", {"temperature": 0.7, "top_k": 20, "seed": 4, **PROCESSING}),
    "greedy_processed": ("processed", PROCESSING),
    "sampled_processed": ("processed", {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5, **PROCESSING}),
}
TOP = 5


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


def reference(model, prompt: list[int], tokens: list[int], mode: str = "raw", settings: dict | None = None,
              eos: int | None = None) -> torch.Tensor:
    """(len(tokens), V) log-probabilities at each new token's position from one pass of the target
    over the whole sequence; "processed": then Hugging Face's processors (sequence bias, repetition
    penalty, min_new_tokens, temperature, top-k, top-p) position by position, with vLLM's presence
    penalty (generated tokens only) written out after the repetition penalty."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
    if mode == "raw":
        return logits.log_softmax(-1)
    s = settings
    warpers = LogitsProcessorList()
    if s.get("temperature"):
        warpers += [TemperatureLogitsWarper(s["temperature"])]
        warpers += [TopKLogitsWarper(s["top_k"])] if s.get("top_k") else []
        warpers += [TopPLogitsWarper(s["top_p"])] if s.get("top_p") else []
    rows = []
    for j in range(len(tokens)):
        ids, scores = torch.tensor([prompt + tokens[:j]]), logits[j: j + 1].clone()
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in s["logit_bias"].items()})(ids, scores)
        scores = RepetitionPenaltyLogitsProcessor(s["repetition_penalty"])(ids, scores)
        scores[0, tokens[:j]] -= s["presence_penalty"]  # indexing with repeats subtracts once
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), s["min_new_tokens"], eos)(ids, scores)
        rows.append(warpers(ids, scores).log_softmax(-1)[0])
    return torch.stack(rows)


def assert_matches(where, tokens, values, top, want: torch.Tensor):
    """values / top (from generate) against the reference log-probabilities `want`. The top lists
    may end in -inf entries (tokens top-k / top-p rule out), whose order is arbitrary."""
    assert len(values) == len(tokens) == len(top) > 0, where
    expected = want.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(values), expected, atol=1e-4), (where, values, expected.tolist())
    assert all(v > float("-inf") for v in values), where  # every token was drawn from its distribution
    best = want.topk(TOP, dim=-1)
    for pos, ids, lps in zip(top, best.indices.tolist(), best.values.tolist()):
        finite = [i for i, lp in enumerate(lps) if lp > float("-inf")]  # ruled-out tokens are left out
        assert [token for token, _ in pos] == [ids[i] for i in finite], where
        assert [lp for _, lp in pos] == pytest.approx([lps[i] for i in finite], abs=1e-4), where


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_logprobs_are_the_targets_own_for_every_drafter_and_setting(arch, tiny_models, tiny_tokenizer, close_drafts):
    target = tiny_models[arch][0]
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t)["input_ids"] for t in PROMPT_TEXTS] + [REPETITIVE]
    base = draftsman.load({"target": {"path": str(target)}})
    for name, drafter in drafters(arch, close_drafts).items():
        decoder = base.with_drafter(drafter)
        for setting, (mode, kwargs) in SETTINGS.items():
            out = decoder.generate(input_ids=prompts, max_new_tokens=NEW, logprobs=mode, top_logprobs=TOP, **kwargs)
            where = f"{arch} {name} {setting}"
            if name.startswith("draft_model"):  # paths several tokens deep, so node slots are read
                assert max(max(row) for row in out.stats.accepted_per_round) >= 2, where
            for prompt, tokens, values, top in zip(prompts, out.token_ids, out.logprobs, out.top_logprobs):
                want = reference(model, prompt, tokens, mode, kwargs, tiny_tokenizer.eos_token_id)
                assert_matches(where, tokens, values, top, want)


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
        want = torch.stack(ref.logits)[:, 0].log_softmax(-1)
        out = decoder.generate(input_ids=[prompt], max_new_tokens=NEW, logprobs=True, top_logprobs=TOP)
        assert out.token_ids[0] == tokens.tolist()
        assert_matches(text, out.token_ids[0], out.logprobs[0], out.top_logprobs[0], want)


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


def test_top_logprobs_leave_out_the_tokens_the_settings_rule_out(tiny_models, capsys):
    """Under top_k 2, "processed" top_logprobs 3 listed a third token at -inf, an arbitrary one of
    those ruled out, and `generate --json` printed it as -Infinity, which JSON parsers refuse."""
    target = str(tiny_models["llama"][0])
    decoder = draftsman.load({"target": {"path": target}})
    out = decoder.generate(input_ids=[[5, 6]], max_new_tokens=4, temperature=1, top_k=2, seed=0,
                           logprobs="processed", top_logprobs=3)
    assert [len(pos) for pos in out.top_logprobs[0]] == [2] * 4
    assert all(token in dict(pos) for token, pos in zip(out.token_ids[0], out.top_logprobs[0]))
    assert cli.main(["generate", "--target", target, "--input-ids", "5,6", "--max-new-tokens", "2", "--temperature",
                     "1", "--top-k", "2", "--json", "--logprobs", "processed", "--top-logprobs", "3"]) == 0

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert [len(pos) for pos in printed["top_logprobs"][0]] == [2, 2]


def test_top_logprobs_stop_at_the_vocabulary(tiny_models):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    out = decoder.generate(input_ids=[[5, 6]], max_new_tokens=2, logprobs=True, top_logprobs=10_000)
    assert [len(pos) for pos in out.top_logprobs[0]] == [decoder.engine.vocab_size] * 2
    assert out.top_logprobs[0][0][0] == (out.token_ids[0][0], out.logprobs[0][0])  # greedy: the top one


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": "yes"}, "logprobs must be False, True (= 'raw': the model's distribution) or 'processed'"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be a whole number >= 0, got -1"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs must be a whole number >= 0, got 2.5"),
    ({"top_logprobs": 3}, "top_logprobs=3 needs logprobs=True: pass both"),
])
def test_bad_logprobs_arguments_are_refused(tiny_models, kwargs, message):
    decoder = draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})
    with pytest.raises(ValueError, match=re.escape(message)):
        decoder.generate(input_ids=[[5, 6]], max_new_tokens=2, **kwargs)
