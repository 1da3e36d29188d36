"""Targets with sliding-window attention (verifier/cached_model.py): Mistral and Phi-3 (every layer
in the window), Qwen2 with use_sliding_window and Gemma 2 / 3 / 4 (full and sliding layers mixed,
Gemma 2 with soft-capping, Gemma 4 with layers that share keys), Llama 4 (chunked layers beside
full NoPE ones, whose queries are scaled by position), and Qwen3 beside them (full attention, a family the other tests lack). Their cache
keeps every slot and the window is in the mask, so greedy output through trees, chains and ragged
batches equals Hugging Face's own `generate`, long after the window."""
import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, Gemma4TextConfig, Llama4TextConfig, MistralConfig, \
    Phi3Config, Qwen2Config, Qwen3Config

import draftsman
from draftsman.verifier import cached_model
from draftsman.verifier.cached_model import _local_attention

from tiny_models import greedy_targets, load_for_reference

WINDOW = 8
ARCHS = ["mistral", "qwen2", "gemma2", "gemma3", "gemma4", "phi3", "llama4", "qwen3"]
NEW = 40
# Longer than the window, and repeating, so that ngram drafts trees that are partly rejected.
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 5, 9, 13, 17], [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11]]


def config(arch: str, vocab_size: int, eos: int):
    common = dict(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, initializer_range=0.2)
    mixed = ["sliding_attention", "full_attention"] * 2
    if arch == "mistral":  # every layer slides
        return MistralConfig(sliding_window=WINDOW, **common)
    if arch == "qwen2":  # layers from max_window_layers on slide
        return Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **common)
    if arch == "phi3":  # Phi-3 mini slides every layer (2047 tokens)
        return Phi3Config(sliding_window=WINDOW, **common)
    if arch == "llama4":  # layers 0-2 attend in chunks of WINDOW with RoPE, layer 3 fully without; its
        # query temperature steps every 4 positions (8192 in the real models), so slots that are not
        # positions would show
        return Llama4TextConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                                attention_chunk_size=WINDOW, floor_scale=4, attn_scale=0.5, **common)
    if arch == "gemma4":  # per-layer input embeddings; its last two layers read earlier layers' keys
        return Gemma4TextConfig(head_dim=16, sliding_window=WINDOW, layer_types=mixed, hidden_size_per_layer_input=16,
                                vocab_size_per_layer_input=vocab_size, num_kv_shared_layers=2, **common)
    if arch == "qwen3":  # full attention; its own q / k norms
        return Qwen3Config(head_dim=16, **common)
    if arch == "gemma2":
        return Gemma2Config(head_dim=16, sliding_window=WINDOW, layer_types=mixed, final_logit_softcapping=30.0,
                            attn_logit_softcapping=50.0, **common)
    return Gemma3TextConfig(head_dim=16, sliding_window=WINDOW, layer_types=mixed, **common)


@pytest.fixture(autouse=True)
def trim_often(monkeypatch):
    """The target's cache lets go of unseen slots from 1 on (64 by default): every test here trims,
    through trees, compaction, rows joining and leaving."""
    monkeypatch.setattr(cached_model, "TRIM_MIN_SLOTS", 1)


@pytest.fixture(scope="module")
def sliding_targets(tmp_path_factory, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    configs = {arch: config(arch, len(tiny_tokenizer), eos) for arch in ARCHS}
    return greedy_targets(tmp_path_factory, tiny_tokenizer, configs, 40, PROMPTS, NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_sliding_window_targets_give_their_own_greedy_output(sliding_targets, arch):
    folder, expected = sliding_targets[arch]
    kind = {"qwen3": None, "llama4": "chunked_attention"}.get(arch, "sliding_attention")
    assert _local_attention(load_for_reference(folder).config)[:2] == (kind, None if arch == "qwen3" else WINDOW)
    # a chain, a copied tree, a model's chain, and a dynamic tree grown a depth a call (earlier
    # depths' slots pending: their positions go into the window too)
    for drafter in ({"name": "none"}, {"name": "ngram"}, {"name": "draft_model", "path": str(folder), "k": 4},
                    {"name": "draft_model", "path": str(folder), "k": 4, "top_k": 2}):
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, drafter  # a ragged batch of two
        alone = dec.generate(input_ids=PROMPTS[1:], max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert alone.token_ids == expected[1:], drafter
        if drafter["name"] == "draft_model":  # the target drafting for itself: every draft accepted
            assert out.stats.tau > 2.5, (drafter, out.stats.tau)


def test_gpt_neo_local_layers_are_refused_by_name(tiny_tokenizer, tmp_path):
    """GPT-Neo's local layers window keys by cache slot, in a buffer of their own: in a ragged batch
    (holes in the cache) they gave other output than the model's own. Its global layers are fine."""
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    with pytest.raises(NotImplementedError, match="GPT-Neo's local attention layers mask keys by their slot"):
        _local_attention(GPTNeoConfig(num_layers=2, attention_types=[[["global", "local"], 1]]))
    eos = tiny_tokenizer.eos_token_id
    config = GPTNeoConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, num_layers=2, num_heads=4,
                          attention_types=[[["global"], 2]], max_position_embeddings=256, initializer_range=0.5,
                          bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    reference = load_for_reference(tmp_path)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20,
                                   do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    dec = draftsman.load({"target": {"path": str(tmp_path)}, "drafter": {"name": "ngram"}})
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=20, min_new_tokens=20, temperature=0.0)
    assert out.token_ids == expected  # a ragged batch, through trees


def test_sliding_and_chunked_layers_together_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="both sliding-window and chunked"):
        _local_attention(Llama4TextConfig(attention_chunk_size=8, num_hidden_layers=2,
                                          layer_types=["chunked_attention", "sliding_attention"]))


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "llama4"])
def test_a_tree_grown_a_depth_a_call_sees_its_ancestors_in_the_window(sliding_targets, arch):
    """A dynamic tree (draft_model's top_k, EAGLE) runs each depth uncommitted on top of the earlier
    depths' slots: each node's logits equal a plain forward over prompt + its path, so the pending
    ancestors are seen at their own positions through the window."""
    from draftsman.drafters.dynamic_tree import grow_level
    from draftsman.verifier.cached_model import CachedLM
    from draftsman.verifier.tree import TreeBlock

    model = load_for_reference(sliding_targets[arch][0])
    lm = CachedLM(model)
    lm.reset(1)
    prompt = PROMPTS[0]
    lm.forward(TreeBlock.chains([prompt], lm.device))
    lm.accept([list(range(len(prompt)))])
    paths = [[3], [4]]  # two branches, grown three depths
    for depth in range(1, 4):
        S = lm.num_slots
        visible = None
        if depth > 1:  # each branch's earlier nodes: the last 2 (depth - 1) pending slots, alternating
            visible = torch.zeros(1, 2, S, dtype=torch.bool)
            for branch in range(2):
                visible[0, branch, [S - 2 * k + branch for k in range(1, depth)]] = True
        tokens = torch.tensor([[path[-1] for path in paths]])
        logits, _ = grow_level(lm, tokens, depth, visible)
        for branch, path in enumerate(paths):
            expected = model(torch.tensor([prompt + path])).logits[0, -1]
            torch.testing.assert_close(logits[0, branch], expected, rtol=1e-4, atol=1e-4)
        paths = [path + [int(logits[0, b].argmax())] for b, path in enumerate(paths)]
    lm.rollback(lm.lengths.clone())
    assert lm.num_slots == len(prompt) and lm._pending_pos.shape[1] == 0


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "llama4"])
def test_sampled_rows_follow_a_sliding_window_target(sliding_targets, arch, tmp_path):
    """T=1: 6000 rows of a 16-token prompt (twice the window), drafted by a perturbed copy of the
    target (drafts accepted and rejected), emit first and second tokens with the target's exact
    marginals (chi-square); the same samples do not fit the target without its window."""
    from test_engine_sampling import ALPHA, ROWS, exact_marginals, fit_pvalue
    from tiny_models import perturbed_copy

    from draftsman.verifier.sampling import SamplingParams

    folder = sliding_targets[arch][0]
    draft = perturbed_copy(folder, tmp_path / "draft", noise=0.3)
    dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "draft_model", "path": str(draft),
                                                                        "k": 3}})
    prompt = PROMPTS[0]
    out = dec.generate(input_ids=[prompt] * ROWS, max_new_tokens=2, temperature=1.0, seed=7)
    assert out.stats.tau > 1.01  # both accept and reject paths
    reference = load_for_reference(folder)
    p1, p2 = exact_marginals(reference, prompt, SamplingParams(1.0), dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(first, p1) > ALPHA and fit_pvalue(second, p2) > ALPHA
    # power: the window changes what these rows emit
    setattr(reference.config, "attention_chunk_size" if arch == "llama4" else "sliding_window", 10 ** 6)
    unwindowed, _ = exact_marginals(reference, prompt, SamplingParams(1.0), dec.engine.eos_token_ids)
    assert fit_pvalue(first, unwindowed) < ALPHA


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "llama4"])
def test_heads_for_a_sliding_window_target_attend_fully_and_draft_exactly(sliding_targets, arch, tmp_path):
    """EAGLE, EAGLE-3 and MTP heads built for such a target: their one layer attends fully (as
    vLLM's EAGLE heads), so EAGLE-3's training-time test unrolls through its own cache (a sliding
    cache there cut the keys short of the mask), and each drafts the target's own greedy output."""
    import contextlib

    from draftsman.heads.feature_head import FeatureHead
    from draftsman.training.eagle3 import aux_target_pass, unroll

    folder, expected = sliding_targets[arch]
    target = load_for_reference(folder)
    for kind in ("eagle", "eagle3", "mtp"):
        head = FeatureHead.for_target(target, kind)
        assert _local_attention(head.body.config)[0] is None, kind
        if kind == "eagle3":
            x = torch.tensor([PROMPTS[0]])
            aux, _, _ = aux_target_pass(target, x, head.config.aux_layers, contextlib.nullcontext)
            steps = unroll(head, aux, x, 3)
            assert [tuple(s.shape) for s in steps] == [(1, len(PROMPTS[0]) - 1, head.config.draft_vocab_size)] * 3
        head.save(tmp_path / kind, target, dtype=torch.float32)
        drafter = {"name": "mtp" if kind == "mtp" else "eagle", "path": str(tmp_path / kind)}
        out = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter}).generate(
            input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, kind


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "llama4"])
def test_rows_joining_a_trimmed_cache_generate_what_they_generate_alone(sliding_targets, arch):
    """Rows join after the local layers let go of slots: they start after those slots, holes before
    them in the full layers. Each prompt's tokens equal its own generation alone."""
    starting, joining = PROMPTS, {3: [[50, 51, 52, 53, 54, 55, 56, 57, 58, 59]], 5: [[60, 61], [3, 4, 5, 6]]}
    prompts = starting + [p for r in sorted(joining) for p in joining[r]]
    folder = sliding_targets[arch][0]
    for drafter in ({"name": "ngram"}, {"name": "draft_model", "path": str(folder), "k": 3}):
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
        alone = [dec.generate(input_ids=[p], max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0).token_ids[0]
                 for p in prompts]
        target, trimmed_at_join, rounds, order = dec.engine.target, [], [0], list(range(len(starting)))
        add_rows = target.add_rows

        def recording(other):
            trimmed_at_join.append(target.local_start)
            for layer, local in target._layers():  # the local layers' storage did shrink
                assert layer.keys.shape[2] == target.num_slots - (target.local_start if local else 0)
            add_rows(other)

        def join():
            rounds[0] += 1
            joined = joining.get(rounds[0] - 1, [])
            order.extend(prompts.index(p) for p in joined)
            return [(p, NEW) for p in joined]

        target.add_rows = recording
        tokens = {}
        for row, chunk in dec.stream_batch(starting, joining=join, max_new_tokens=NEW, min_new_tokens=NEW,
                                           temperature=0.0):
            tokens.setdefault(order[row], []).extend(chunk.token_ids)
        assert [tokens[i] for i in range(len(prompts))] == alone, drafter
        assert len(trimmed_at_join) == 2 and all(trimmed_at_join), (drafter, trimmed_at_join)


def _image_text_checkpoint(arch: str, tokenizer, folder):
    """A tiny image-text checkpoint of `arch` whose text model is this module's config of it."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Mistral3Config,
                              Mistral3ForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)

    torch.manual_seed(3)
    text_arch = {"mistral3": "mistral", "qwen2_5_vl": "qwen2"}.get(arch, arch)
    text = config(text_arch, len(tokenizer), tokenizer.eos_token_id).to_dict()
    if arch == "gemma3":
        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                      patch_size=14)
        checkpoint = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                                 mm_tokens_per_image=4))
    elif arch == "mistral3":
        vision = dict(model_type="pixtral", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, image_size=28, patch_size=14, head_dim=16)
        checkpoint = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision))
    else:
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
        checkpoint = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={**text, "model_type": "qwen2_5_vl_text"}, vision_config=vision))
    # as Gemma 3's: the end of a turn ends a reply too, said by the generation config only
    checkpoint.generation_config.eos_token_id = [tokenizer.eos_token_id, 300]
    checkpoint.eval().save_pretrained(folder)
    return checkpoint


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "llama4"])
def test_a_sliding_window_draft_model_keeps_about_a_window_and_drafts_afresh(sliding_targets, arch, tmp_path):
    """The draft model's cache lets go of unseen window slots too, keeping the k positions a
    round's rollback goes back (trim_margin): every chain it proposes is its greedy continuation
    of the row computed afresh, through partial acceptance (two copies) and full acceptance
    (the target drafting for itself), in a ragged batch."""
    from tiny_models import perturbed_copy
    from toy_drafters import watching_proposals

    folder, expected = sliding_targets[arch]
    k = 4
    kept = set()  # drafts the copies had accepted in a round
    for draft in (perturbed_copy(folder, tmp_path / "close", noise=0.05),
                  perturbed_copy(folder, tmp_path / "far", noise=0.3), folder):
        draft_model = load_for_reference(draft)
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "draft_model", "path": str(draft),
                                                                            "k": k}})
        wrong, held = [], []

        def afresh(contexts, trees):
            lm = dec.drafter.lm
            held.append((lm.num_slots, lm.num_slots - lm.local_start))  # all slots, those local layers hold
            for context, tree in zip(contexts, trees):
                own = draft_model.generate(torch.tensor([context]), max_new_tokens=tree.size,
                                           min_new_tokens=tree.size, do_sample=False)[0, len(context):].tolist()
                if own != tree.tokens.tolist():
                    wrong.append((len(context), own, tree.tokens.tolist()))

        with watching_proposals(dec, afresh):
            out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected and not wrong, (draft.name, wrong[:2])
        # Local layers held about a window (+ k, + a round's slots) while the cache grew past it.
        assert max(all_slots for all_slots, _ in held) > len(PROMPTS[0]) + NEW // 2
        assert held[-1][1] <= 2 * WINDOW + 2 * k, held[-1]
        if draft == folder:
            assert all(n == k for row in out.stats.accepted_per_round for n in row[:-1]), out.stats.accepted_per_round
        kept |= {n for row in out.stats.accepted_per_round for n in row} if draft != folder else set()
    assert len(kept) >= 3, kept  # rollbacks to several depths


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "llama4"])  # sliding; full beside sliding; chunked
def test_a_sliding_window_cross_tokenizer_draft_keeps_about_a_window(sliding_targets, arch, tmp_path):
    """cross_tokenizer's draft model (another vocabulary) lets go of unseen window slots as
    draft_model's does, and proposes what an untrimmed cache proposes, round for round, through
    partial acceptance in a ragged batch, greedy and sampled (drafts drawn from it, seeded). With a
    margin shorter than a round goes back, its rows are fed afresh and propose the same again."""
    from tiny_models import permuted_vocab_copy, perturbed_copy
    from toy_drafters import watching_proposals

    folder, expected = sliding_targets[arch]
    draft = permuted_vocab_copy(perturbed_copy(folder, tmp_path / "close", noise=0.1), tmp_path / "shuffled")
    runs = {}
    for run in ("untrimmed", "trimmed", "short margin"):
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "cross_tokenizer",
                                                                            "path": str(draft), "k": 4}})
        lm = dec.drafter.lm
        if run == "untrimmed":
            lm.trim_windows = False
        if run == "short margin":
            lm.trim_margin = 2  # a round that accepts fewer than all its drafts goes back further
        proposals, held = [], []

        def watch(contexts, trees, lm=lm, proposals=proposals, held=held):
            held.append((lm.num_slots, lm.num_slots - lm.local_start))  # all slots, those local layers hold
            proposals.append([tree.tokens.tolist() for tree in trees])

        with watching_proposals(dec, watch):
            out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
            fed, greedy_held = dec.drafter.report()["rows_fed_afresh"], list(held)
            sampled = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=1.0,
                                   seed=3).token_ids
        assert out.token_ids == expected, run
        runs[run] = (proposals, greedy_held, fed, sampled)
    assert runs["trimmed"][0] == runs["untrimmed"][0] == runs["short margin"][0]
    assert runs["trimmed"][3] == runs["untrimmed"][3] == runs["short margin"][3]
    untrimmed, trimmed = runs["untrimmed"][1], runs["trimmed"][1]
    assert all(local == slots for slots, local in untrimmed)
    # Local layers held about a window (+ the margin, + what rows apart in length keep) while the
    # cache grew past it.
    most = max(slots for slots, _ in trimmed)
    assert most > len(PROMPTS[0]) + NEW // 2 and trimmed[-1][1] <= most // 2, trimmed
    assert runs["trimmed"][2] == 0 and runs["short margin"][2] > 0


def test_a_trimmed_cache_refuses_to_go_back_further_than_its_margin(sliding_targets):
    from draftsman.verifier.cached_model import CachedLM

    lm = CachedLM(load_for_reference(sliding_targets["mistral"][0]), trim_windows=True, trim_margin=2)
    lm.reset(1)
    lm.feed([list(range(3, 40))])
    assert lm.local_start > 0
    lm.rollback(lm.lengths - 2)  # within the margin
    lm.rollback(torch.zeros(1, dtype=torch.long))  # to 0: the row is fed afresh
    lm.feed([list(range(3, 40))])
    with pytest.raises(RuntimeError, match="rollback\\(\\) of 3 positions .* trim_margin 2"):
        lm.rollback(lm.lengths - 3)
    # reachable() says so first: within the margin as asked, further back 0 (the row fed afresh)
    assert lm.reachable(lm.lengths - 2).tolist() == (lm.lengths - 2).tolist()
    assert lm.reachable(lm.lengths - 3).tolist() == [0]


@pytest.mark.parametrize("arch", ["gemma3", "mistral3"])
def test_an_image_text_checkpoint_verifies_as_its_text_model(tiny_tokenizer, tmp_path, arch):
    """Gemma 3's and Mistral 3's released checkpoints are image-text ones (AutoModelForCausalLM
    loads Gemma 3's as Gemma3ForConditionalGeneration; Mistral 3's only AutoModelForImageTextToText
    does). draftsman takes the text model around the same weights: greedy output through ngram and
    an EAGLE head equals the checkpoint's own `generate`."""
    from draftsman.heads.feature_head import FeatureHead
    from draftsman.models import load_causal_lm

    checkpoint = _image_text_checkpoint(arch, tiny_tokenizer, tmp_path / "mm")
    expected = [checkpoint.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                    do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    target = load_causal_lm(tmp_path / "mm")
    assert type(target).__name__ == {"gemma3": "Gemma3ForCausalLM", "mistral3": "MistralForCausalLM"}[arch]
    assert not any("vision" in name for name, _ in target.named_parameters())
    FeatureHead.for_target(target, "eagle").save(tmp_path / "eagle", target, dtype=torch.float32)
    for drafter in ({"name": "ngram"}, {"name": "eagle", "path": str(tmp_path / "eagle")}):
        dec = draftsman.load({"target": {"path": str(tmp_path / "mm")}, "drafter": drafter})
        assert 300 in dec.engine.eos_token_ids
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, drafter


def test_models_without_a_text_causal_lm_are_refused_by_name(tiny_tokenizer, tmp_path):
    from transformers import T5Config

    from draftsman.models import load_causal_lm

    _image_text_checkpoint("qwen2_5_vl", tiny_tokenizer, tmp_path / "vl")
    with pytest.raises(NotImplementedError, match="'qwen2_5_vl' is a multimodal model.*Qwen2.5, Qwen3"):
        load_causal_lm(tmp_path / "vl")
    T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16).save_pretrained(tmp_path / "t5")
    with pytest.raises(ValueError, match="holds a 't5' model, which is neither a causal LM nor an image-text model"):
        load_causal_lm(tmp_path / "t5")


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma2", "gemma3", "phi3", "llama4", "qwen3"])
def test_layer_skip_drafts_what_the_kept_layers_compute(sliding_targets, arch):
    """The target drafting with layers 0, 2 and 3 of its 4 (`layer_skip`): each kept layer attends
    with its own kind (sliding, chunked or full), so every round's drafts are what a model of only
    those layers computes, and the output is the target's own. A view that read the layer kinds
    by position among the kept layers (as the model's forward indexes them) drafts otherwise."""
    from test_layer_skip import check_drafts_against, model_of_layers

    folder, expected = sliding_targets[arch]
    dec = draftsman.load({"target": {"path": str(folder)},
                          "drafter": {"name": "layer_skip", "skip_layers": [1], "k": 3}})
    checked, out = check_drafts_against(dec, model_of_layers(folder, [0, 2, 3]), PROMPTS, NEW, min_new_tokens=NEW)
    assert checked > 10 and out.token_ids == expected


def test_layer_skip_refuses_gemma4_by_name(sliding_targets):
    """Gemma 4 feeds each layer an embedding of its own and its last layers read earlier layers'
    keys: a view of part of its layers would fail inside the model, so it is refused first."""
    with pytest.raises(ValueError, match=r"gemma4_text\) gives each layer an input embedding .*gemma4_assistant"):
        draftsman.load({"target": {"path": str(sliding_targets["gemma4"][0])},
                        "drafter": {"name": "layer_skip", "exit_layer": 2}})
