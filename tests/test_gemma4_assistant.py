"""`gemma4_assistant`: a Gemma 4 assistant drafting from its target's own keys, read from the
verifier's cache. A tiny random Gemma 4 target (sliding and full layers, KV-sharing layers,
per-layer inputs) and a tiny random assistant; the reference is Hugging Face's assistant called on
the target's shared_kv_states, as its Gemma4AssistantCandidateGenerator calls it."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

import draftsman
from draftsman.verifier import cached_model

from test_engine_sampling import assert_sampled_marginals_fit
from tiny_models import load_for_reference

WINDOW = 8
NEW = 16
# Longer than the window (its last window + 1 keys are what the assistant's sliding layers see),
# short, and one token (nothing to draft from in round 1).
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 5, 9], [7, 8, 9, 10], [3]]


def _text(vocab_size: int, eos: int, hidden: int, layers: int, **extra) -> Gemma4TextConfig:
    kinds = ["sliding_attention", "full_attention"] * (layers // 2)
    return Gemma4TextConfig(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                            max_position_embeddings=256, initializer_range=0.2, sliding_window=WINDOW,
                            layer_types=kinds, **extra)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_tokenizer):
    """(target folder, assistant folder, assistant folder made for a wider target, greedy outputs)."""
    root = tmp_path_factory.mktemp("gemma4")
    V, eos = len(tiny_tokenizer), tiny_tokenizer.eos_token_id
    torch.manual_seed(60)
    target = AutoModelForCausalLM.from_config(_text(V, eos, 64, 4, hidden_size_per_layer_input=16,
                                                    vocab_size_per_layer_input=V, num_kv_shared_layers=2))
    target.save_pretrained(root / "target")
    target.generation_config.save_pretrained(root / "target")
    tiny_tokenizer.save_pretrained(root / "target")
    folders = []
    for name, backbone in (("assistant", 64), ("assistant-for-another", 96)):
        torch.manual_seed(61)
        text = _text(V, eos, 32, 2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
        assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(text_config=text, backbone_hidden_size=backbone))
        assistant.save_pretrained(root / name)
        folders.append(root / name)
    reference = load_for_reference(root / "target")
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    return root / "target", folders[0], folders[1], expected


def _decoder(target, assistant, **options):
    return draftsman.load({"target": {"path": str(target), "device": "cpu"},
                           "drafter": {"name": "gemma4_assistant", "path": str(assistant), **options}})


def _hf_chain(target, assistant, context: list[int], depth: int) -> list[int]:
    """Hugging Face's assistant after `context` (its last token the root): the target's keys and
    top state of the tokens before the root, the position the root's, each token the argmax."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
        state, token, chain = out.hidden_states[-1][:, -1:], torch.tensor([[context[-1]]]), []
        for _ in range(depth):
            step = assistant(inputs_embeds=torch.cat([target.get_input_embeddings()(token), state], -1),
                             attention_mask=None, position_ids=torch.tensor([[len(context) - 1]]),
                             shared_kv_states=out.shared_kv_states)
            token, state = step.logits.argmax(-1), step.last_hidden_state
            chain.append(int(token))
    return chain


def _recording(dec):
    """dec's drafter, recording each round's contexts, trees and where the target's sliding layers
    start holding slots."""
    rounds = []
    propose = dec.drafter.propose

    def recorded(contexts):
        trees = propose(contexts)
        rounds.append(([list(c) for c in contexts], trees, dec.engine.target.local_start))
        return trees

    dec.drafter.propose = recorded
    return rounds


@pytest.mark.parametrize("trim", [False, True], ids=["whole-cache", "trimmed-cache"])
def test_drafts_are_hugging_faces_assistant_chain(pair, monkeypatch, trim):
    """Every round's chain, for a ragged batch, is the one Hugging Face's assistant drafts from the
    target's keys of the same tokens. Trimmed (one row: a batch trims only what its shortest row
    no longer sees): the target's sliding layers let go of what their own window no longer sees,
    but keep the keys the assistant reads, its window and two more."""
    target_dir, assistant_dir, _, expected = pair
    if trim:
        monkeypatch.setattr(cached_model, "TRIM_MIN_SLOTS", 1)
    rows = PROMPTS[:1] if trim else PROMPTS
    dec = _decoder(target_dir, assistant_dir, depth=3)
    rounds = _recording(dec)
    out = dec.generate(input_ids=rows, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected[: len(rows)]
    if trim:
        assert min(start for _, _, start in rounds[1:]) > 0  # its sliding layers let go of slots
    reference, assistant = load_for_reference(target_dir), dec.drafter.assistant
    checked = 0
    for contexts, trees, _ in rounds:
        for context, tree in zip(contexts, trees):
            if len(context) > 1:  # (the engine cuts a row's last trees to the tokens it has left)
                assert tree.tokens.tolist() == _hf_chain(reference, assistant, context, 3)[: tree.size], context
                checked += 1
            else:
                assert tree.size == 0  # nothing before the root: nothing to draft from
    assert checked >= (4 if trim else 12)


@pytest.mark.parametrize("depth", [1, 4])
def test_greedy_output_equals_the_targets_own(pair, depth):
    target_dir, assistant_dir, _, expected = pair
    dec = _decoder(target_dir, assistant_dir, depth=depth)
    for rows in (PROMPTS[:1], PROMPTS):
        out = dec.generate(input_ids=rows, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected[: len(rows)]
        assert out.stats.proposed_at_depth[depth - 1] > 0


@pytest.mark.parametrize("wrapped", ["adaptive", "cascade"])
def test_greedy_output_through_adaptive_speculation_and_a_cascade(pair, wrapped):
    """Wrappers pass the target's cache on to the assistant they hold (and a cascade keeps the
    keys its child reads when the target's cache trims)."""
    target_dir, assistant_dir, _, expected = pair
    assistant = {"name": "gemma4_assistant", "path": str(assistant_dir), "depth": 3}
    drafter = ({**assistant, "adaptive": True} if wrapped == "adaptive" else
               {"name": "cascade", "drafters": [{"name": "ngram"}, assistant]})
    dec = draftsman.load({"target": {"path": str(target_dir), "device": "cpu"}, "drafter": drafter})
    assert dec.engine.target.trim_margin == 2
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected
    assert sum(out.stats.proposed_at_depth) > 0


def test_rows_that_join_a_running_batch_draft_from_their_own_keys(pair):
    """Continuous batching: rows join after the first; the target cache's rows stay the drafter's."""
    target_dir, assistant_dir, _, expected = pair
    dec = _decoder(target_dir, assistant_dir, depth=3)
    rounds = _recording(dec)
    waves, order = [[1, 2]], [0]

    def joining():
        if not waves or not rounds:
            return []
        wave = waves.pop(0)
        order.extend(wave)
        return [(PROMPTS[i], NEW) for i in wave]

    tokens: dict[int, list[int]] = {}
    for row, chunk in dec.stream_batch([PROMPTS[0]], joining=joining, max_new_tokens=NEW, min_new_tokens=NEW,
                                       temperature=0.0):
        tokens.setdefault(order[row], []).extend(chunk.token_ids)
    assert [tokens[i] for i in range(3)] == expected
    reference, assistant = load_for_reference(target_dir), dec.drafter.assistant
    joined = [(c, t) for contexts, trees, _ in rounds if len(contexts) == 3 for c, t in zip(contexts, trees)][:6]
    assert joined
    for context, tree in joined:
        if len(context) > 1:
            assert tree.tokens.tolist() == _hf_chain(reference, assistant, context, 3), context


def test_sampling_follows_the_target(pair, T=0.3):
    """At T > 0 each drafted token is drawn from the assistant's distribution and returned with it
    (a random model's distributions are near uniform: a low temperature makes p and q peaked)."""
    target_dir, assistant_dir, _, _ = pair
    assert_sampled_marginals_fit(_decoder(target_dir, assistant_dir, depth=2), target_dir, [1, 2, 3, 4, 5, 1, 2, 3], T)


def _processors(rule: str, eos: int, prompt_length: int) -> tuple[dict, dict, list]:
    """Our generate()'s settings for one of the request's rules, Hugging Face's generate()'s, and
    its processors that apply the rule to a context's logits (the reference the drafts meet)."""
    from transformers.generation import logits_process as hf

    if rule == "repetition_penalty":
        settings = {"repetition_penalty": 4.0}
        return settings, settings, [hf.RepetitionPenaltyLogitsProcessor(4.0)]
    if rule == "no_repeat_ngram_size":  # 1: no token twice
        settings = {"no_repeat_ngram_size": 1}
        return settings, settings, [hf.NoRepeatNGramLogitsProcessor(1)]
    if rule == "logit_bias":  # EOS favoured everywhere, and banned until min_new_tokens
        return ({"logit_bias": {eos: 30.0}, "min_new_tokens": NEW - 2},
                {"sequence_bias": {(eos,): 30.0}, "min_new_tokens": NEW - 2},
                [hf.SequenceBiasLogitsProcessor({(eos,): 30.0}),
                 hf.MinNewTokensLengthLogitsProcessor(prompt_length, NEW - 2, eos)])
    raise ValueError(rule)


@pytest.mark.parametrize("rule", ["repetition_penalty", "no_repeat_ngram_size", "logit_bias"])
def test_drafts_follow_the_requests_rules(pair, rule, depth=6):
    """Greedy: each drafted token is the argmax of the assistant's logits after Hugging Face's
    processor for the request's rule, applied over the row's context and the drafts above it;
    the rule changes some drafts (so this can fail), and output equals the target's own under it."""
    target_dir, assistant_dir, _, _ = pair
    dec = _decoder(target_dir, assistant_dir, depth=depth)
    eos = min(dec.engine.eos_token_ids)
    rows = PROMPTS[:2]
    settings, theirs, _ = _processors(rule, eos, 0)
    steps, step = [], dec.drafter._step

    def recorded(*args):
        logits, state = step(*args)
        steps.append(logits.float().clone())
        return logits, state

    dec.drafter._step = recorded
    rounds = _recording(dec)
    out = dec.generate(input_ids=rows, max_new_tokens=NEW, temperature=0.0, **settings)
    reference = load_for_reference(target_dir)
    for b, prompt in enumerate(rows):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, **theirs)
        assert out.token_ids[b] == want[0, len(prompt):].tolist()
    checked = changed = 0
    for contexts, trees, _ in rounds:
        raw, steps = steps[:depth], steps[depth:]  # the round's chain: one assistant call per token
        for b, (context, tree) in enumerate(zip(contexts, trees)):
            drafted = tree.tokens.tolist()
            _, _, processors = _processors(rule, eos, len(rows[b]))
            for d, token in enumerate(drafted):
                ids = torch.tensor([context + drafted[:d]])
                scores = raw[d][b : b + 1].clone()
                for processor in processors:
                    scores = processor(ids, scores)
                assert token == int(scores.argmax()), (rule, context, drafted, d)
                changed += token != int(raw[d][b].argmax())
                checked += 1
    assert not steps and checked >= 12 and changed > 0


def test_a_target_that_is_not_gemma_4_is_refused(pair, tiny_models):
    with pytest.raises(ValueError, match=r"is 'llama', not Gemma 4"):
        _decoder(tiny_models["llama"][0], pair[1])


def test_an_assistant_made_for_another_target_is_refused(pair):
    with pytest.raises(ValueError, match=r"made for another target: it reads states 96 wide, the target's are 64"):
        _decoder(pair[0], pair[2])


def test_a_folder_that_holds_no_assistant_is_named(pair, tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"holds a LlamaForCausalLM, not a Gemma 4 assistant.*'draft_model'"):
        _decoder(pair[0], tiny_models["llama"][0])
    (tmp_path / "nothing").mkdir()  # (a folder that does not exist is named before the target loads)
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        _decoder(pair[0], tmp_path / "nothing")


def test_an_assistant_given_as_a_draft_model_points_to_its_drafter(pair):
    with pytest.raises(NotImplementedError, match="is a Gemma 4 assistant.*use drafter: gemma4_assistant"):
        draftsman.load({"target": {"path": str(pair[0])}, "drafter": {"name": "draft_model", "path": str(pair[1])}})
