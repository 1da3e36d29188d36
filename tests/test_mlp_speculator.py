"""`mlp_speculator`: IBM's MLP speculators (fms-extras' MLPSpeculator, the released *-accelerator
checkpoints). Random speculators for the tiny Llama target are written in the checkpoint layouts
those use; the reference is fms-extras' generate_suffixes, restated below from its source."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file

import draftsman
from draftsman.heads.mlp_speculator import MLPSpeculator, load_mlp_speculator
from draftsman.verifier.sampling import SamplingParams

from test_engine_sampling import assert_sampled_marginals_fit
from tiny_models import load_for_reference

PROMPTS = [[5, 9, 13, 17, 21, 25, 5, 9], [7, 8, 9, 10], [3]]
NEW = 16
STAGES, INNER = 3, 48


def _write(folder, hidden: int, vocab: int, tie: bool = False, scale_input: bool = False, prefix: str = "",
           seed: int = 0, drop: str | None = None):
    """A random speculator in `folder`: config.json as fms-extras' MLPSpeculatorConfig writes it,
    weights under their fms names (emb.i, proj.i, head.i, ln.i); a tied one holds each shared
    tensor once, as safetensors keeps it. Head weights large enough for peaked distributions."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(STAGES):
        if tie and i > 0:  # stage 0's embedding, head and norm; stage 1's projection for stages 2+
            if i == 1:
                tensors["proj.1.weight"] = torch.randn(INNER, INNER, generator=g) / math.sqrt(INNER)
            continue
        tensors[f"emb.{i}.weight"] = torch.randn(vocab, INNER, generator=g) / math.sqrt(INNER)
        tensors[f"proj.{i}.weight"] = torch.randn(INNER, hidden if i == 0 else INNER, generator=g) / math.sqrt(INNER)
        tensors[f"head.{i}.weight"] = torch.randn(vocab, INNER, generator=g) * 0.6
        tensors[f"ln.{i}.weight"] = 1 + 0.1 * torch.randn(INNER, generator=g)
        tensors[f"ln.{i}.bias"] = 0.1 * torch.randn(INNER, generator=g)
    if drop:
        del tensors[drop]
    folder.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "vocab_size": vocab, "emb_dim": hidden, "inner_dim": INNER, "n_predict": STAGES,
              "top_k_tokens_per_head": [4, 3, 2], "n_candidates": 5, "tie_weights": tie, "scale_input": scale_input}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def speculators(tiny_models, tmp_path_factory):
    """{name: folder} of speculators for the tiny Llama target, and the target's greedy outputs."""
    target_dir = tiny_models["llama"][0]
    reference = load_for_reference(target_dir)
    hidden, vocab = reference.config.hidden_size, reference.config.vocab_size
    root = tmp_path_factory.mktemp("mlp-speculators")
    folders = {"plain": _write(root / "plain", hidden, vocab),
               "tied-scaled": _write(root / "tied", hidden, vocab, tie=True, scale_input=True, seed=1),
               "hf-wrapper": _write(root / "wrapped", hidden, vocab, prefix="speculator.", seed=2),
               "wider": _write(root / "wider", hidden + 8, vocab),
               "missing": _write(root / "missing", hidden, vocab, drop="ln.1.bias")}
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    return folders, expected


def _decoder(tiny_models, folder, **options):
    return draftsman.load({"target": {"path": str(tiny_models["llama"][0]), "device": "cpu"},
                           "drafter": {"name": "mlp_speculator", "path": str(folder), **options}})


def _fms_stages(folder):
    """fms-extras' MLPSpeculator, restated from its source, in float64: (first(hidden) -> stage 0's
    state, stage(i, states (k, d), tokens (k,)) -> (next states, log-probabilities (k, V)))."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    w = {k.removeprefix("speculator."): v.double() for k, v in load_file(folder / "model.safetensors").items()}
    shared = {"emb": 0, "head": 0, "ln": 0, "proj": 1}  # which stage a tied checkpoint keeps
    weight = lambda kind, i, part="weight": w.get(f"{kind}.{i}.{part}", w.get(f"{kind}.{shared[kind]}.{part}"))  # noqa: E731
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    state_weight = 0.5 ** (0.5 / STAGES)
    emb_weight = math.sqrt((1 - state_weight ** 2) * (INNER / 2))

    def first(hidden):
        state = hidden.double()[None]
        return rms(state) / 2 ** 0.5 if config["scale_input"] else state

    def stage(i, state, tokens):
        state = state @ weight("proj", i).T + weight("emb", i)[tokens] * (emb_weight / state_weight)
        state = torch.nn.functional.gelu(rms(state) * weight("ln", i) + weight("ln", i, "bias"))
        return state, (state @ weight("head", i).T).log_softmax(-1)

    return first, stage


def _fms_suffixes(folder, hidden, root, topk: list[int], n: int) -> list[list[int]]:
    """fms-extras' generate_suffixes for one row: the n best of the prod(topk) candidate
    sequences by summed log-probability, best first."""
    first, stage = _fms_stages(folder)
    state, seqs, logp, tokens = first(hidden), [[]], torch.zeros(1, dtype=torch.float64), torch.tensor([root])
    for i in range(len(topk)):  # (a tied speculator's stages past its last take the shared weights)
        state, logprobs = stage(i, state, tokens)
        top, preds = logprobs.topk(topk[i], dim=-1)  # (candidates, topk[i])
        seqs = [s + [int(t)] for s, row in zip(seqs, preds) for t in row]
        logp = (logp[:, None] + top).reshape(-1)
        state, tokens = state.repeat_interleave(topk[i], 0), preds.reshape(-1)
    return [seqs[j] for j in logp.topk(n).indices.tolist()]


def _fms_next(folder, hidden, root, path: list[int]) -> torch.Tensor:
    """fms-extras' log-probabilities (V,) of the token after the drafted `path` below the root."""
    first, stage = _fms_stages(folder)
    state = first(hidden)
    for i, token in enumerate([root] + path):
        state, logprobs = stage(i, state, torch.tensor([token]))
    return logprobs[0]


def _root_state(reference, context):
    """The target's last hidden state (after its final norm) at the position that predicted the root."""
    with torch.no_grad():
        return reference(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]


def _recording(dec):
    rounds, propose = [], dec.drafter.propose

    def recorded(contexts):
        trees = propose(contexts)
        rounds.append(([list(c) for c in contexts], trees))
        return trees

    dec.drafter.propose = recorded
    return rounds


@pytest.mark.parametrize("name, depth", [("plain", STAGES), ("tied-scaled", STAGES), ("tied-scaled", 5),
                                         ("hf-wrapper", STAGES)])
def test_greedy_chains_are_fms_extras_best_suffix(tiny_models, speculators, name, depth):
    """Every round's chain, for a ragged batch, is the best candidate fms-extras' speculator
    generates from the target's hidden state and the root (the released checkpoints' layouts:
    fms names, tied weights with the input norm, the Hugging Face wrapper's prefix; a tied one
    run past its stages, as vLLM runs it). Output is the target's own."""
    folders, expected = speculators
    dec = _decoder(tiny_models, folders[name], depth=depth)
    rounds = _recording(dec)
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected
    reference, checked = load_for_reference(tiny_models["llama"][0]), 0
    for contexts, trees in rounds:
        for context, tree in zip(contexts, trees):
            if len(context) == 1:
                assert tree.size == 0  # no hidden state before the root yet
                continue
            best = _fms_suffixes(folders[name], _root_state(reference, context), context[-1], [1] * depth, 1)[0]
            assert tree.tokens.tolist() == best[: tree.size], context
            checked += 1
    assert checked >= 12


def test_each_tree_node_is_a_top_k_child_of_its_own_path(tiny_models, speculators):
    """top_k > 1 at T=0: a connected dynamic tree of at most total_tokens nodes, each node among
    the top 3 tokens fms-extras' speculator gives after the node's own path (each node carries
    its own state); output equals the target's at batch 1 and 3."""
    folders, expected = speculators
    dec = _decoder(tiny_models, folders["plain"], top_k=3, total_tokens=12)
    rounds = _recording(dec)
    for rows in (PROMPTS[:1], PROMPTS):
        assert dec.generate(input_ids=rows, max_new_tokens=NEW, min_new_tokens=NEW,
                            temperature=0.0).token_ids == expected[: len(rows)]
    reference, checked, deep = load_for_reference(tiny_models["llama"][0]), 0, 0
    for contexts, trees in rounds[:6]:
        for context, tree in zip(contexts, trees):
            if len(context) == 1:
                continue
            parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
            assert 0 < len(tokens) <= 12 and all(-1 <= p < j for j, p in enumerate(parents))  # parents first
            hidden, paths = _root_state(reference, context), []
            for j, p in enumerate(parents):
                above = paths[p] if p >= 0 else []
                top = _fms_next(folders["plain"], hidden, context[-1], above).topk(3).indices.tolist()
                assert tokens[j] in top, (context, above, tokens[j], top)
                paths.append(above + [tokens[j]])
                checked += 1
                deep += len(above) == STAGES - 1
    assert checked >= 40 and deep > 0


def test_a_draft_vocabulary_keeps_its_heads_rows_and_stays_exact(tiny_models, speculators, tmp_path):
    """draft_vocab: greedy chains are fms-extras' best suffix with each stage's choice among the
    kept tokens only (vocab_order: a released speculator's config.json has no token order);
    output is the target's own; sampled rounds draft among all tokens unless
    draft_vocab_sampling, and stay exact either way."""
    folders, expected = speculators
    V = load_for_reference(tiny_models["llama"][0]).config.vocab_size
    order = torch.randperm(V, generator=torch.Generator().manual_seed(3)).tolist()
    (tmp_path / "order.json").write_text(json.dumps({"tokens_by_frequency": order}))
    kept = torch.tensor(sorted(order[:40]))
    dec = _decoder(tiny_models, folders["plain"], draft_vocab=40, vocab_order=str(tmp_path / "order.json"))
    rounds = _recording(dec)
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected
    first, stage = _fms_stages(folders["plain"])
    reference, checked = load_for_reference(tiny_models["llama"][0]), 0
    for contexts, trees in rounds:
        for context, tree in zip(contexts, trees):
            if len(context) == 1:
                continue
            state, token, best = first(_root_state(reference, context)), torch.tensor([context[-1]]), []
            for i in range(STAGES):
                state, logprobs = stage(i, state, token)
                token = kept[logprobs[:, kept].argmax(-1)]
                best.append(int(token))
            assert tree.tokens.tolist() == best[: tree.size], context
            checked += 1
    assert checked >= 12
    sampled = dec.generate(input_ids=[PROMPTS[0]] * 8, max_new_tokens=8, temperature=1.0, seed=0)
    assert sum(sampled.stats.proposed_at_depth) > 0
    for sampling_too in (False, True):
        drafter = _decoder(tiny_models, folders["plain"], draft_vocab=40, vocab_order=str(tmp_path / "order.json"),
                           draft_vocab_sampling=sampling_too)
        drafter.drafter.begin([PROMPTS[0]], SamplingParams(1.0), torch.Generator())
        assert (drafter.drafter.vocab_map is not None) == sampling_too
    with pytest.raises(ValueError, match="draft_vocab needs the target's token order.*set vocab_order"):
        _decoder(tiny_models, folders["plain"], draft_vocab=40)


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["all-tokens", "draft-vocab"])
def test_sampling_follows_the_target(tiny_models, speculators, tmp_path, draft_vocab, T=0.3):
    """At T > 0 each chain token is drawn from its stage's distribution and returned with it (with
    draft_vocab_sampling: over the kept tokens, placed back in the whole vocabulary)."""
    folders, _ = speculators
    options = {}
    if draft_vocab:
        V = load_for_reference(tiny_models["llama"][0]).config.vocab_size
        (tmp_path / "order.json").write_text(json.dumps(list(range(V))[::-1]))
        options = {"draft_vocab": V // 2, "vocab_order": str(tmp_path / "order.json"), "draft_vocab_sampling": True}
    assert_sampled_marginals_fit(_decoder(tiny_models, folders["plain"], **options), tiny_models["llama"][0],
                                 [1, 2, 3, 4, 5, 1, 2, 3], T)


@pytest.mark.parametrize("top_k", [1, 2])
def test_drafts_follow_a_logit_bias(tiny_models, speculators, top_k):
    """The token it drafts most below the root is never drafted once banned by logit_bias."""
    folders, _ = speculators
    dec = _decoder(tiny_models, folders["plain"], top_k=top_k)
    counts = torch.zeros(dec.engine.vocab_size, dtype=torch.long)
    for _, trees in _drafted_rounds(dec):
        for tree in trees:
            counts += torch.bincount(tree.tokens[tree.parents == -1], minlength=counts.numel())
    banned = int(counts.argmax())
    assert counts[banned] > 1
    rounds = _drafted_rounds(dec, logit_bias={banned: -100})
    assert all(banned not in tree.tokens.tolist() for _, trees in rounds for tree in trees)


def _drafted_rounds(dec, **settings):
    rounds = _recording(dec)
    dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, temperature=0.0, **settings)
    return rounds


def test_a_speculator_for_another_target_is_refused(tiny_models, speculators):
    folders, _ = speculators
    with pytest.raises(ValueError, match=r"made for another target: it reads states \d+ wide, the target's are"):
        _decoder(tiny_models, folders["wider"])


def test_missing_weights_and_folders_are_named(tiny_models, speculators, tmp_path):
    folders, _ = speculators
    with pytest.raises(ValueError, match=r"do not fit its config.json .*missing \['ln.1.bias'\]"):
        _decoder(tiny_models, folders["missing"])
    (tmp_path / "nothing").mkdir()  # (a folder that does not exist is named before the target loads)
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        _decoder(tiny_models, tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"holds a 'llama' model, not an MLP speculator.*'draft_model'"):
        _decoder(tiny_models, tiny_models["llama"][1])
    with pytest.raises(ValueError, match=r"depth 4 is more than the speculator's 3 stages"):
        _decoder(tiny_models, folders["plain"], depth=4)


def test_a_speculator_given_as_a_draft_model_points_to_its_drafter(tiny_models, speculators):
    folders, _ = speculators
    with pytest.raises(ValueError, match="holds an MLP speculator.*use drafter: mlp_speculator"):
        draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                        "drafter": {"name": "draft_model", "path": str(folders["plain"])}})


@pytest.fixture(scope="module")
def trained(tiny_models, tiny_corpus, tmp_path_factory):
    """(folder, metrics) of a tied speculator trained briefly on the tiny Llama target."""
    from draftsman.training.heads import train

    out = tmp_path_factory.mktemp("trained-speculator")
    cfg = {"kind": "mlp_speculator", "target": str(tiny_models["llama"][0]), "out": str(out / "speculator"),
           "work_dir": str(out / "work"), "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no",
           "seq_len": 64, "batch_size": 4, "lr": 1e-2, "warmup_steps": 2, "max_steps": 120, "eval_tokens": 256,
           "num_heads": 3, "inner_dim": 32, "tie_weights": True}
    return out / "speculator", train(cfg)


def test_a_trained_speculator_is_evaluated_and_trained_again_in_its_own_folder(trained, tmp_path):
    """Its config.json is fms-extras' (a model_type, no kind): the heads trainer took it for a model's
    folder and refused `--eval-only` on it and a rerun into it. Its save id says this package wrote it."""
    from draftsman.training.heads import evaluate_only, load_config

    folder, metrics = trained
    assert load_config(metrics["config"])["out"] == str(folder)
    ev = evaluate_only(metrics["config"])["heldout_agreement"]
    assert ev["top1"] == metrics["heldout_agreement"]["top1"]
    with pytest.raises(ValueError, match="holds mlp_speculator heads: saving medusa heads there would replace them"):
        load_config({**metrics["config"], "kind": "medusa"})
    # Saved before save ids (the bundled zoo/python-mlp-speculator): its target's fingerprint marks it ours.
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    config = json.loads((older / "config.json").read_text())
    del config["save_id"]
    (older / "config.json").write_text(json.dumps(config))
    assert load_config({**metrics["config"], "out": str(older)})["out"] == str(older)
    del config["target"]  # a released speculator's config.json: another's model, refused
    (older / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds a 'mlp_speculator' model: saving heads there would replace"):
        load_config({**metrics["config"], "out": str(older)})


def test_training_lowers_the_loss_and_saves_the_fms_extras_layout(trained, tiny_models, tiny_corpus, tmp_path):
    """The loss falls and stage 0 learns the target's choice; the folder is fms-extras' layout
    (config.json as MLPSpeculatorConfig reads it, each tied tensor once) with the target's
    fingerprint; the drafter loads it, and output through it is the target's own."""
    folder, metrics = trained
    assert metrics["curve"][-1][1] < metrics["curve"][0][1]
    agreement = metrics["heldout_agreement"]
    assert len(agreement["top1"]) == 3 and agreement["top1"][0] > 0.2
    assert all(0 <= a <= b <= 1 for a, b in zip(agreement["top1"], agreement["top5"]))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert (config["n_predict"], config["inner_dim"], config["tie_weights"]) == (3, 32, True)
    assert len(config["top_k_tokens_per_head"]) == 3 and config["target"]["architecture"] == "LlamaForCausalLM"
    from safetensors.torch import load_file
    assert sorted(load_file(folder / "model.safetensors")) == ["emb.0.weight", "head.0.weight", "ln.0.bias",
                                                               "ln.0.weight", "proj.0.weight", "proj.1.weight"]
    dec = _decoder(tiny_models, folder, depth=4)
    text = "".join(sorted(path.read_text() for path in tiny_corpus.rglob("*.py")))
    ids = dec.tokenizer(text)["input_ids"]
    prompts = [ids[start: start + 24] for start in (0, 200, 400, 600)]  # text like what it learnt on
    out = dec.generate(input_ids=prompts, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    reference = load_for_reference(tiny_models["llama"][0])
    for row, prompt in zip(out.token_ids, prompts):
        assert row == reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                         min_new_tokens=NEW)[0, len(prompt):].tolist()
    # Its drafts are accepted more than an untrained one's of the same shape.
    untrained = MLPSpeculator.for_target(reference, n_predict=3, inner_dim=32, tie_weights=True)
    untrained.save(tmp_path / "untrained", reference)
    chance = _decoder(tiny_models, tmp_path / "untrained", depth=4).generate(input_ids=prompts, max_new_tokens=NEW,
                                                                          temperature=0.0)
    assert out.stats.tau > max(1.0, chance.stats.tau)


def test_a_trained_speculator_for_another_target_is_refused(trained, tiny_models):
    """Its config.json records the target it was trained for (a released one records none)."""
    folder, _ = trained
    with pytest.raises(ValueError, match="trained for another target"):
        draftsman.load({"target": {"path": str(tiny_models["qwen2"][0])},
                        "drafter": {"name": "mlp_speculator", "path": str(folder)}})


def test_a_config_and_weights_of_two_saves_are_refused(tiny_models, tmp_path):
    """A kill between a save's two renames leaves one save's config.json beside another's weights."""
    reference = load_for_reference(tiny_models["llama"][0])
    for name in ("first", "second"):
        MLPSpeculator.for_target(reference, n_predict=2, inner_dim=16).save(tmp_path / name, reference)
    load_mlp_speculator(tmp_path / "first", reference)
    shutil.copy(tmp_path / "second" / "config.json", tmp_path / "first" / "config.json")
    with pytest.raises(ValueError, match="two different saves"):
        load_mlp_speculator(tmp_path / "first", reference)


@pytest.mark.parametrize("wrapped", ["adaptive", "cascade"])
def test_greedy_output_through_adaptive_speculation_and_a_cascade(tiny_models, speculators, wrapped):
    folders, expected = speculators
    speculator = {"name": "mlp_speculator", "path": str(folders["tied-scaled"]), "depth": 5}
    drafter = ({**speculator, "adaptive": True} if wrapped == "adaptive" else
               {"name": "cascade", "drafters": [{"name": "ngram", "min_ngram": 3}, speculator]})
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0]), "device": "cpu"}, "drafter": drafter})
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected and sum(out.stats.proposed_at_depth) > 0


def test_int8_weights_draft_what_float_weights_mostly_draft_and_stay_exact(tiny_models, speculators):
    """quantize: int8 (CPU): int8 projections and LM heads, each tied weight converted once; the
    chains agree with the float speculator's on most tokens, and output is the target's own."""
    from draftsman.drafters.int8_linear import int8_runs_on

    if not int8_runs_on(torch.device("cpu")):
        pytest.skip("this PyTorch build has no int8 CPU engine")
    folders, expected = speculators
    drafted = {}
    for quantize in (None, "int8"):
        dec = _decoder(tiny_models, folders["tied-scaled"], depth=5, draft_vocab=None, quantize=quantize)
        rounds = _recording(dec)
        assert dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW,
                            temperature=0.0).token_ids == expected
        drafted[quantize] = [t.tokens.tolist() for _, trees in rounds for t in trees]
        if quantize:  # stage 0's projection and stage 1's, shared by stages 1-4; one LM head for all five
            speculator = dec.drafter.speculator
            assert len({id(layer) for layer in speculator.proj}) == 2
            assert len({id(head) for head in dec.drafter.readouts[True][0]}) == 1
            assert dec.drafter.extra_parameters() == sum(p.numel() for p in speculator.parameters()) + sum(
                layer.in_features * layer.out_features for layer in {id(x): x for x in speculator.proj}.values())
    same = sum(a == b for x, y in zip(drafted[None], drafted["int8"]) for a, b in zip(x, y))
    total = sum(len(x) for x in drafted[None])
    assert drafted[None] != [] and same >= 0.8 * total
