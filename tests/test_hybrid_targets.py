"""Targets with recurrent layers: hybrids, whose recurrent layers (Gated DeltaNet in Qwen3-Next and
Qwen3.5, Mamba-2 in Nemotron-H and Bamba, Mamba in Jamba, short convolutions in LFM2) sit beside
attention layers, and Mamba, Mamba-2 and Falcon Mamba, all recurrent. A recurrent state cannot
skip a rejected draft, so each row keeps the state it had after its kept tokens
(verifier/recurrent_state.py) and the target reads a tree as its branches (test_hybrid_branches.py).
Greedy output equals Hugging Face's own `generate` through partial acceptance at every depth, ragged
batches and joining rows; sampled rows keep the target's distribution."""
import pytest
import torch
from transformers import AutoModelForCausalLM, BambaConfig, FalconH1Config, FalconMambaConfig, JambaConfig, \
    Lfm2Config, Mamba2Config, MambaConfig, NemotronHConfig, OlmoHybridConfig, Qwen3_5TextConfig, Qwen3NextConfig

import draftsman
from draftsman.drafters import DETERMINISTIC, IID, DraftTree, register
from draftsman.verifier import hf_compat
from draftsman.verifier.cached_model import CachedLM, _local_attention
from draftsman.verifier.tree import TreeBlock

from tiny_models import greedy_targets, load_for_reference
from toy_drafters import ToyDrafter

ARCHS = ["qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "bamba", "olmo_hybrid", "jamba", "mamba", "mamba2",
         "falcon_mamba"]
NEW = 40
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 5, 9, 13, 17], [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11]]
MIXED = ["linear_attention", "full_attention"] * 2


def config(arch: str, vocab_size: int, eos: int):
    common = dict(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, initializer_range=0.2)
    delta_net = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    if arch == "qwen3_5":  # Gated DeltaNet: a conv state and a recurrent state per layer
        return Qwen3_5TextConfig(head_dim=16, layer_types=MIXED, **delta_net, **common)
    if arch == "qwen3_next":  # the same mixer, with experts
        return Qwen3NextConfig(head_dim=16, layer_types=MIXED, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, **delta_net, **common)
    if arch == "lfm2":  # short convolutions: a conv state only
        common.pop("intermediate_size")
        return Lfm2Config(layer_types=["conv", "full_attention"] * 2, **common)
    if arch == "nemotron_h":  # Mamba-2, attention and plain MLP layers (their cache layer holds nothing)
        return NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "mamba"], head_dim=16, mamba_num_heads=4,
                               mamba_head_dim=16, ssm_state_size=16, n_groups=1, **common)
    if arch == "bamba":  # Mamba-2 beside attention
        return BambaConfig(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                           mamba_n_groups=1, **common)
    if arch == "olmo_hybrid":
        return OlmoHybridConfig(layer_types=MIXED, **common)
    if arch == "jamba":  # Mamba beside attention; its scan restarts from zero (recurrent_state.py)
        return JambaConfig(attn_layer_period=2, attn_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                           expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, **common)
    # Recurrent layers only: no attention, no position limit
    ssm = dict(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, hidden_size=64,
               num_hidden_layers=4, initializer_range=1.0)  # their default init repeats one token
    if arch == "mamba2":
        return Mamba2Config(num_heads=4, head_dim=32, n_groups=1, **ssm)
    return {"mamba": MambaConfig, "falcon_mamba": FalconMambaConfig}[arch](**ssm)


KNOWN: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + the target's greedy output


class NoisyOracle(ToyDrafter):
    """Drafts the target's greedy continuation with one token wrong, at a depth that moves each
    round (so rows accept 0..k drafts); the wrong chain is the root's first child, and a
    second child holds the right first token (a tree: the hybrid target reads it as two branches)."""
    name = "hybrid_noisy_oracle"
    calls = 0
    can_add_rows = True  # no per-row state: a row's drafts follow from its context

    def propose(self, contexts):
        trees = []
        self.calls += 1
        for row, context in enumerate(contexts):
            full = next((seq for seq in KNOWN.values() if seq[: len(context)] == context), None)
            if full is None or len(full) == len(context):
                trees.append(DraftTree.empty())
                continue
            right = full[len(context): len(context) + self.k]
            wrong_at = (self.calls + row) % (self.k + 1)  # k + 1 of them: the whole chain right
            chain = [t if i != wrong_at else (t + 1) % self.vocab for i, t in enumerate(right)]
            parents = list(range(-1, len(chain) - 1)) + [-1]
            trees.append(DraftTree(torch.tensor(chain + right[:1]), torch.tensor(parents),
                                   torch.full((len(chain) + 1,), DETERMINISTIC)))
        return trees


@pytest.fixture(autouse=True)
def noisy_oracle():
    register(NoisyOracle)  # for this test only: conftest's forget_test_drafters takes it out after


@pytest.fixture(scope="module")
def hybrid_targets(tmp_path_factory, tiny_tokenizer):
    if not hf_compat.RECORDS_RECURRENT_STATES:  # the engine refuses hybrids there, as a test below checks
        pytest.skip("this transformers release does not record recurrent states (5.25 does)")
    eos = tiny_tokenizer.eos_token_id
    configs = {arch: config(arch, len(tiny_tokenizer), eos) for arch in ARCHS}
    return greedy_targets(tmp_path_factory, tiny_tokenizer, configs, 60, PROMPTS, NEW)


def knowing(expected):
    KNOWN.clear()
    KNOWN.update({tuple(p): p + e for p, e in zip(PROMPTS, expected)})


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_targets_give_their_own_greedy_output(hybrid_targets, arch):
    folder, expected = hybrid_targets[arch]
    assert CachedLM(load_for_reference(folder)).recurrent
    assert all(len(set(e)) > 5 for e in expected)  # varied output: a wrong state would show
    knowing(expected)
    for drafter in ({"name": "none"}, {"name": "ngram"}, {"name": "hybrid_noisy_oracle", "k": 4}):
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, drafter  # a ragged batch of two: prefilled in two passes
        alone = dec.generate(input_ids=PROMPTS[1:], max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert alone.token_ids == expected[1:], drafter
        if drafter["name"] == "hybrid_noisy_oracle":  # rows kept every number of drafts, 0 to k
            kept = {n for row in out.stats.accepted_per_round for n in row}
            assert kept == {0, 1, 2, 3, 4}, kept


@pytest.mark.parametrize("arch", ["qwen3_5", "jamba", "mamba"])
def test_each_row_keeps_the_state_after_its_own_tokens(hybrid_targets, arch):
    """The cache alone: ragged prompts, a chain of 4 per row of which rows keep 0, 2 and 4 tokens,
    then rows selected and one prefilled apart joined; every next-token logit equals a fresh
    forward over the row's whole sequence. Jamba and Mamba: their scans restart from zero, and
    their steps update the state in place."""
    from draftsman.verifier.prefill import Prefill

    model = load_for_reference(hybrid_targets[arch][0])
    lm = CachedLM(model)
    rows = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    prefill = Prefill(lm, [r + [0] for r in rows], (), "cpu")
    while not prefill.step(chunk=3):  # passes end at 2, 3 (a chunk), 4, 6 (a chunk), 7
        pass
    prefill.finish()
    drafts = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]]
    lm.forward(TreeBlock.chains(drafts, "cpu"))
    kept = [0, 2, 4]
    lm.accept([list(range(n)) for n in kept])
    rows = [r + d[:n] for r, d, n in zip(rows, drafts, kept)]

    def check(lm, rows):
        nxt = [[40 + i] for i in range(len(rows))]
        logits, _ = lm.forward(TreeBlock.chains(nxt, "cpu"))
        lm.accept([[0]] * len(rows))
        for b, row in enumerate(rows):
            fresh = model(torch.tensor([row + nxt[b]])).logits[0, -1]
            # Mamba's cache steps token by token where a fresh forward scans: float32 sums in
            # another order, up to ~1e-3 with its weights this large (a wrong state is off by units)
            torch.testing.assert_close(logits[b, 0], fresh, rtol=2e-3, atol=2e-3)
        return [r + n for r, n in zip(rows, nxt)]

    rows = check(lm, rows)
    apart = CachedLM(model)
    joining = [[50, 51, 52, 53, 54]]
    Prefill(apart, [joining[0] + [0]], (), "cpu").step()
    lm.add_rows(apart)
    lm.select_rows([3, 0, 2])
    check(lm, joining + [rows[0], rows[2]])
    with pytest.raises(NotImplementedError, match="cannot forget tokens"):
        lm.rollback(lm.lengths - 1)


@pytest.mark.parametrize("chunk", [None, 2], ids=["whole-prefill", "chunked-prefill"])
def test_rows_joining_a_hybrid_target_generate_what_they_generate_alone(hybrid_targets, chunk, tmp_path):
    """Through the noisy oracle, and a hybrid draft model whose cache takes the joining rows empty."""
    from test_continuous_batching import LIMITS, PROMPTS as JOINING, joined_run

    from tiny_models import perturbed_copy

    folder = hybrid_targets["nemotron_h"][0]
    plain = draftsman.load({"target": {"path": str(folder)}})
    alone = [plain.generate(input_ids=[p], max_new_tokens=m, temperature=0.0).token_ids[0]
             for p, m in zip(JOINING, LIMITS)]
    KNOWN.clear()
    KNOWN.update({tuple(p): p + a for p, a in zip(JOINING, alone)})
    close = perturbed_copy(folder, tmp_path / "close", noise=0.05)
    for drafter in ({"name": "hybrid_noisy_oracle", "k": 3}, {"name": "draft_model", "path": str(close), "k": 3}):
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})
        dec.engine.join_prefill_chunk = chunk
        tokens, _, stats = joined_run(dec, temperature=0.0)
        assert [tokens[i] for i in range(len(JOINING))] == alone, drafter
        assert stats.tau > 1.5, (drafter, stats.tau)  # drafts were accepted, and others rejected


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_sampled_rows_follow_a_hybrid_target(hybrid_targets, arch):
    """T=0.5: 6000 rows drafted by the noisy oracle (drafts accepted and rejected at each depth) emit
    first and second tokens with the target's exact marginals (chi-square)."""
    from test_engine_sampling import ALPHA, ROWS, exact_marginals, fit_pvalue

    from draftsman.verifier.sampling import SamplingParams

    folder, expected = hybrid_targets[arch]
    knowing(expected)
    dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "hybrid_noisy_oracle", "k": 3}})
    prompt = PROMPTS[0]
    out = dec.generate(input_ids=[prompt] * ROWS, max_new_tokens=2, temperature=0.5, seed=11)
    assert out.stats.tau > 1.05  # both accept and reject paths
    p1, p2 = exact_marginals(load_for_reference(folder), prompt, SamplingParams(0.5), dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) >= 2])
    assert fit_pvalue(first, p1) > ALPHA and fit_pvalue(second, p2) > ALPHA


@pytest.mark.parametrize("arch,kinds", [("qwen3_5", ("eagle", "eagle3", "mtp", "eagle3-llama")),
                                        ("lfm2", ("eagle", "mtp")),
                                        ("nemotron_h", ("mtp", "eagle-llama", "eagle3-llama")),
                                        ("bamba", ("eagle-llama",)), ("olmo_hybrid", ("eagle-llama",)),
                                        ("mamba", ("eagle-llama", "eagle3-llama")), ("jamba", ("eagle-llama",)),
                                        ("falcon_mamba", ("eagle-llama", "eagle3-llama"))])
def test_heads_for_a_hybrid_target_draft_its_own_greedy_output(hybrid_targets, arch, kinds, tmp_path):
    """EAGLE, EAGLE-3 and MTP heads built for a hybrid target (their one layer attends) draft trees
    the target reads as branches. "-llama": `layer: llama`, a Llama layer of the target's sizes
    (Qwen3.5's partial RoPE and gated q_proj left out), which also gives EAGLE heads to the targets
    whose own layer cannot be one: Nemotron-H and OLMo hybrid (no input norm in their attention
    blocks), Bamba (derived layer kinds), Jamba (its scan restarts from zero) and Mamba and Falcon
    Mamba (no attention at all)."""
    from draftsman.heads.feature_head import FeatureHead

    folder, expected = hybrid_targets[arch]
    target = load_for_reference(folder)
    for kind in kinds:
        head_kind, _, layer = kind.partition("-")
        head = FeatureHead.for_target(target, head_kind, layer=layer or "target")
        assert not CachedLM(head.body).recurrent, kind
        if layer:  # the engines' Llama layer turns the whole head: an export must not say otherwise
            assert "partial_rotary_factor" not in (head.body.config.rope_parameters or {}), kind
        head.save(tmp_path / kind, target, dtype=torch.float32)
        drafter = {"name": "mtp" if kind == "mtp" else "eagle", "path": str(tmp_path / kind)}
        out = draftsman.load({"target": {"path": str(folder)}, "drafter": drafter}).generate(
            input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected, kind


def test_heads_a_hybrid_target_cannot_have_are_refused_by_name(hybrid_targets):
    from draftsman.heads.feature_head import FeatureHead

    bamba = load_for_reference(hybrid_targets["bamba"][0])  # its layer kinds derive from attn_layer_indices
    mamba = AutoModelForCausalLM.from_config(MambaConfig(num_hidden_layers=2, hidden_size=64, vocab_size=320))
    for target in (bamba, mamba):
        with pytest.raises(NotImplementedError,
                           match="one layer must attend.*`layer: llama`.*'draft_model' or 'ngram'"):
            FeatureHead.for_target(target, "mtp")
    nemotron = load_for_reference(hybrid_targets["nemotron_h"][0])  # its attention block has no input norm
    with pytest.raises(NotImplementedError, match="cannot find the input norm.*'mtp' head keeps it.*`layer: llama`"):
        FeatureHead.for_target(nemotron, "eagle")


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_a_hybrid_draft_model_drafts_what_it_would_from_scratch(hybrid_targets, arch, tmp_path):
    """The draft model's own cache goes back to the accepted drafts each round (snapshots of its
    recurrent states): every chain it proposes is its greedy continuation of the row computed
    afresh, through partial acceptance, a ragged first feed (a 20-token prompt: a pass per
    length), and a context window of 24 positions that moves (the row refed from empty). Drafting
    for itself, every draft is accepted."""
    import json

    from draftsman.drafters.context_window import window_start

    from tiny_models import perturbed_copy
    from toy_drafters import watching_proposals

    folder, _ = hybrid_targets[arch]
    prompts = [PROMPTS[0] + [1, 2, 3, 4], PROMPTS[1]]
    reference = load_for_reference(folder)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False)[0, len(p):].tolist() for p in prompts]
    windowed = perturbed_copy(folder, tmp_path / "windowed", noise=0.05)
    settings = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 24}))
    for draft, k in ((folder, 4), (perturbed_copy(folder, tmp_path / "close", noise=0.05), 4), (windowed, 3)):
        draft_model = load_for_reference(draft)
        room = draft_model.config.max_position_embeddings - k
        dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "draft_model", "path": str(draft),
                                                                            "k": k}})
        wrong, windows = [], set()

        def afresh(contexts, trees):
            for context, tree in zip(contexts, trees):
                windows.add(window_start(len(context), room))
                seen = context[window_start(len(context), room):]
                own = draft_model.generate(torch.tensor([seen]), max_new_tokens=tree.size, min_new_tokens=tree.size,
                                           do_sample=False)[0, len(seen):].tolist()
                if own != tree.tokens.tolist():
                    wrong.append((len(context), own, tree.tokens.tolist()))

        with watching_proposals(dec, afresh):
            out = dec.generate(input_ids=prompts, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
        assert out.token_ids == expected and not wrong, (draft.name, wrong[:2])
        if draft == folder:
            assert all(n == k for row in out.stats.accepted_per_round for n in row[:-1]), out.stats.accepted_per_round
        else:
            kept = {n for row in out.stats.accepted_per_round for n in row}
            assert len(kept) >= 3, kept  # rollbacks to several depths
        if draft == windowed:
            assert len(windows) >= 3, windows  # the window moved, twice at least


@pytest.mark.parametrize("arch", ["jamba", "mamba"])
def test_a_hybrid_draft_model_drafts_for_repeated_prompts(hybrid_targets, arch, tmp_path):
    """Rows of one prompt feed the draft model's empty cache once and copy its row
    (drafters/first_feed.py): each copy keeps the snapshot at the prompt's length, so its first
    round's rollback returns there (it raised "cannot return to length ..." before)."""
    from tiny_models import perturbed_copy

    folder, expected = hybrid_targets[arch]
    draft = perturbed_copy(folder, tmp_path / "close", noise=0.05)
    dec = draftsman.load({"target": {"path": str(folder)}, "drafter": {"name": "draft_model", "path": str(draft),
                                                                        "k": 3}})
    a = PROMPTS[0]
    out = dec.generate(input_ids=[a, a], max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == [expected[0]] * 2
    assert len({n for row in out.stats.accepted_per_round for n in row}) >= 2  # rollbacks to several depths
    # num_return_sequences copies each prompt's rows the same way (sampled: greedy copies are refused)
    sampled = dec.generate(input_ids=[a, a], max_new_tokens=NEW, min_new_tokens=NEW, temperature=1.0, seed=0,
                           num_return_sequences=2)
    assert [len(row) for row in sampled.token_ids] == [NEW] * 4


def test_a_hybrid_draft_model_is_refused_where_it_cannot_go_back(hybrid_targets):
    folder = str(hybrid_targets["lfm2"][0])
    with pytest.raises(ValueError, match="top_k=2 grows a tree .* set drafter.top_k to 1"):
        draftsman.load({"target": {"path": folder}, "drafter": {"name": "draft_model", "path": folder, "top_k": 2}})
    # cross_tokenizer re-encodes text, and may go back to any length: refused
    with pytest.raises(ValueError, match="has recurrent layers.*can be the target, not the draft model"):
        draftsman.load({"target": {"path": folder}, "drafter": {"name": "cross_tokenizer", "path": folder}})


def test_unsupported_hybrids_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="attention and a recurrent mixer in one layer"):
        _local_attention(FalconH1Config(num_hidden_layers=2))


@pytest.mark.parametrize("arch", ["rwkv", "xlstm", "minimax", "recurrent_gemma", "openai-gpt", "bart", "trocr",
                                  "roformer"])
def test_models_whose_state_is_not_in_the_cache_are_refused_by_name(arch, tmp_path, tiny_tokenizer, tiny_models):
    """Their state lives outside the cache draftsman passes and takes back (RWKV's `state`, xLSTM's
    and MiniMax's own caches, RecurrentGemma's modules; GPT-1 has no cache), or they take no
    position_ids (BART's and TrOCR's decoders, RoFormer: positions from the cache's length): a run
    would not fail, it would be wrong (RWKV's always; the others' in ragged batches). Refused at
    load, before the weights, naming where the state is."""
    import transformers

    small = dict(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2)
    config = {"rwkv": lambda: transformers.RwkvConfig(**small),
              "xlstm": lambda: transformers.xLSTMConfig(**small, num_heads=4),
              "minimax": lambda: transformers.MiniMaxConfig(**small, num_attention_heads=4, num_key_value_heads=2,
                                                            num_local_experts=2, intermediate_size=64),
              "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(**small, num_attention_heads=4,
                                                                           lru_width=64, intermediate_size=64),
              "openai-gpt": lambda: transformers.OpenAIGPTConfig(vocab_size=len(tiny_tokenizer), n_embd=64, n_layer=2,
                                                                 n_head=4),
              "bart": lambda: transformers.BartConfig(vocab_size=len(tiny_tokenizer), d_model=64),
              "trocr": lambda: transformers.TrOCRConfig(vocab_size=len(tiny_tokenizer), d_model=64),
              "roformer": lambda: transformers.RoFormerConfig(**small, is_decoder=True)}[arch]()
    config.save_pretrained(tmp_path)  # the config alone: the check comes before any weight is read
    tiny_tokenizer.save_pretrained(tmp_path)
    where = {"rwkv": r"an argument of its own \(`state`\)", "xlstm": "a cache class of its own",
             "minimax": "a cache class of its own", "recurrent_gemma": "its modules", "openai-gpt": "takes no cache",
             "bart": "takes no position_ids", "trocr": "takes no position_ids", "roformer": "takes no position_ids"}
    with pytest.raises(NotImplementedError, match=f"target.path: '{arch}' .*{where[arch]}.*could not be kept exact"):
        draftsman.load({"target": {"path": str(tmp_path)}})
    with pytest.raises(NotImplementedError, match=f"'{arch}' .*{where[arch]}"):  # nor as a draft model
        draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                        "drafter": {"name": "draft_model", "path": str(tmp_path)}})


def test_a_model_of_recurrent_layers_only_has_no_context_limit():
    from draftsman.models import UNBOUNDED_CONTEXT, context_length

    assert context_length(MambaConfig(num_hidden_layers=2)) == UNBOUNDED_CONTEXT
    with pytest.raises(ValueError, match="cannot tell the context length"):  # Bloom: attention, no limit named
        from transformers import BloomConfig
        context_length(BloomConfig(n_layer=2))


def test_the_cost_profile_runs_on_a_hybrid_target(hybrid_targets, capsys):
    """python -m draftsman.bench.costs: each repeat keeps none of its block (a rollback, which a
    target's recurrent state cannot do, raised before)."""
    from draftsman.bench.costs import main

    assert main(["--target", str(hybrid_targets["qwen3_5"][0]), "--batches", "1", "2", "--tokens", "1", "3",
                 "--cached", "20", "--repeats", "2"]) == 0
    assert "break-even" in capsys.readouterr().out


def test_a_transformers_release_without_state_recording_is_named(monkeypatch):
    monkeypatch.setattr(hf_compat, "RECORDS_RECURRENT_STATES", False)
    with pytest.raises(NotImplementedError, match=r"has recurrent layers.*needs transformers >= 5\.25"):
        CachedLM(AutoModelForCausalLM.from_config(config("lfm2", 320, 0)))


def test_first_chain_keeps_each_first_child_as_drawn():
    probs = torch.softmax(torch.randn(5, 8), -1)
    # root -> 0 -> 2 -> 4, with siblings 1 (of 0) and 3 (of 2)
    tree = DraftTree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, 0, 0, 2]),
                     torch.tensor([IID, IID, DETERMINISTIC, IID, IID]), probs)
    chain = tree.first_chain()
    assert chain.tokens.tolist() == [1, 3, 5] and chain.parents.tolist() == [-1, 0, 1]
    assert chain.kinds.tolist() == [IID, DETERMINISTIC, IID]
    assert torch.equal(chain.draft_probs, probs[[0, 2, 4]])
    plain = DraftTree.chain([1, 2, 3])
    assert plain.first_chain() is plain


def test_layer_skip_refuses_a_hybrid_target_by_name(hybrid_targets):
    """A view of part of a hybrid's layers would carry recurrent states beside the target's: refused
    before any drafting, with the reason (also before draft_model's own refusal of a tree, which
    could not name the model: a view has no path)."""
    with pytest.raises(ValueError, match="layer_skip: .* has recurrent layers, whose states a view of part of its"):
        draftsman.load({"target": {"path": str(hybrid_targets["qwen3_5"][0])},
                        "drafter": {"name": "layer_skip", "exit_layer": 1, "top_k": 2}})
