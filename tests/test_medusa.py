"""Medusa heads: training on a frozen tiny target lowers the loss; save/load round trip; heads for
another target are refused; output through the `medusa` drafter equals the target's own greedy
output (batch 1 and 4) and follows its distribution when sampling."""
import contextlib
import json
import shutil

import pytest
import torch

import draftsman
from draftsman.drafters.medusa import tree_from_accuracies
from draftsman.drafters.rank_trees import sorted_tree
from draftsman.heads.medusa import MedusaHeads
from draftsman.training.heads import train

from test_engine_sampling import exact_marginals, fit_pvalue
from tiny_models import load_for_reference


@pytest.fixture(scope="module")
def trained_heads(tiny_models, tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa")
    cfg = {"target": str(tiny_models["llama"][0]), "out": str(out / "heads"), "work_dir": str(out / "work"),
           "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no", "num_heads": 3,
           "seq_len": 64, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "max_steps": 40,
           "eval_tokens": 256, "tree_budget": 6}
    metrics = train(cfg)
    return out / "heads", metrics


def test_training_lowers_the_loss_and_writes_a_calibrated_tree(trained_heads):
    folder, metrics = trained_heads
    curve = metrics["curve"]
    assert curve[-1][1] < curve[0][1]
    config = json.loads((folder / "config.json").read_text())
    assert len(config["tree"]) == 6 and config["target"]["architecture"] == "LlamaForCausalLM"
    agreement = metrics["heldout_agreement"]
    assert all(0 <= a <= b <= 1 for a, b in zip(agreement["top1"], agreement["top5"]))


def test_save_load_round_trip(trained_heads, tiny_models):
    folder, _ = trained_heads
    target = load_for_reference(tiny_models["llama"][0])
    heads, _ = MedusaHeads.load(folder, target)
    hidden = torch.randn(5, target.config.hidden_size)
    again, _ = MedusaHeads.load(folder, target)
    assert torch.equal(heads(hidden), again(hidden))
    fresh = MedusaHeads.for_target(target, num_heads=2)  # zero-initialised blocks = the LM head
    assert torch.allclose(fresh(hidden)[1], target.get_output_embeddings()(hidden), atol=1e-5)


def test_heads_for_another_target_are_refused(trained_heads, tiny_models):
    folder, _ = trained_heads
    with pytest.raises(ValueError, match="trained for another target"):
        MedusaHeads.load(folder, load_for_reference(tiny_models["qwen2"][0]))
    with pytest.raises(ValueError, match="trained for another target"):
        draftsman.load({"target": {"path": str(tiny_models["gpt2"][0])}, "drafter": {"name": "medusa", "path": str(folder)}})


def test_heads_for_a_target_that_only_shares_the_lm_head_are_refused(trained_heads, tiny_models, tmp_path):
    """A depth-pruned target, or one whose layers were retrained, keeps the LM head the record
    probed: both were taken for the heads' own target (export wrote them for it, too)."""
    folder, _ = trained_heads
    source = tiny_models["llama"][0]
    MedusaHeads.load(folder, load_for_reference(source).to(torch.bfloat16))  # bf16 storage: the same target
    quantized = load_for_reference(source)  # int8 matrices (as bitsandbytes keeps them) are not read
    for layer in quantized.model.layers:
        layer.mlp.up_proj.weight = torch.nn.Parameter(layer.mlp.up_proj.weight.to(torch.int8), requires_grad=False)
    MedusaHeads.load(folder, quantized)
    retrained = load_for_reference(source)
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in retrained.model.layers.parameters():
            weight.normal_(0, 0.05)
    with pytest.raises(ValueError, match="trained for another target: the target's layer weights differ"):
        MedusaHeads.load(folder, retrained)
    pruned = load_for_reference(source)
    layers = pruned.config.num_hidden_layers
    del pruned.model.layers[1:]
    pruned.config.num_hidden_layers = 1
    with pytest.raises(ValueError, match=f"num_hidden_layers is {layers} in the record but 1 in this target"):
        MedusaHeads.load(folder, pruned)
    # Records written before the layers were (the bundled zoo heads) are checked on what they hold.
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    del config["target"]["num_hidden_layers"], config["target"]["body_probe"]
    (old / "config.json").write_text(json.dumps(config))
    MedusaHeads.load(old, load_for_reference(source))
    with pytest.raises(ValueError, match="trained for another target"):
        MedusaHeads.load(old, load_for_reference(tiny_models["qwen2"][0]))


def test_a_model_folder_given_as_heads_is_named(tiny_models):
    """The target's own folder as drafter.path: it said "holds None heads"."""
    target = str(tiny_models["llama"][0])
    with pytest.raises(ValueError, match="holds a 'llama' model, not 'medusa' heads: point drafter.path at a heads "
                                         "folder .*draftsman train medusa.* drafter draft_model"):
        draftsman.load({"target": {"path": target}, "drafter": {"name": "medusa", "path": target}})


@pytest.mark.parametrize("tree,draft_vocab", [(None, None), ([[0], [0, 0], [0, 0, 0]], None),
                                              ([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], None), (None, 64)])
def test_greedy_output_equals_the_target(trained_heads, tiny_models, tree, draft_vocab):
    folder, _ = trained_heads
    target = str(tiny_models["llama"][0])
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3], [40, 41]]
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=prompts, max_new_tokens=30)
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "medusa", "path": str(folder), "tree": tree,
                                                                  "draft_vocab": draft_vocab}})
    assert dec.generate(input_ids=prompts, max_new_tokens=30).token_ids == plain.token_ids
    assert [dec.generate(input_ids=[p], max_new_tokens=30).token_ids[0] for p in prompts] == plain.token_ids


@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_greedy_output_under_a_repetition_penalty_equals_the_target(trained_heads, tiny_models, draft_vocab):
    """The heads' candidates are penalised for the committed text (drafters/repeats.py)."""
    folder, _ = trained_heads
    target = str(tiny_models["llama"][0])
    prompts = [[5, 6, 7, 8], [9], [1, 2, 3, 1, 2, 3], [40, 41]]
    plain = draftsman.load({"target": {"path": target}}).generate(input_ids=prompts, max_new_tokens=30,
                                                                   repetition_penalty=1.3)
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "medusa", "path": str(folder),
                                                                  "draft_vocab": draft_vocab}})
    assert dec.generate(input_ids=prompts, max_new_tokens=30, repetition_penalty=1.3).token_ids == plain.token_ids


def test_sampling_follows_the_target(trained_heads, tiny_models):
    folder, _ = trained_heads
    target = str(tiny_models["llama"][0])
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    dec = draftsman.load({"target": {"path": target}, "drafter": {"name": "medusa", "path": str(folder)}})
    # 3 new tokens: the heads draft from round 1 on (the prefill's hidden state).
    out = dec.generate(input_ids=[prompt] * 4000, max_new_tokens=3, temperature=1.0, seed=7)
    p1, p2 = exact_marginals(load_for_reference(tiny_models["llama"][0]), prompt,
                             draftsman.verifier.sampling.SamplingParams(1.0), dec.engine.eos_token_ids)
    first = torch.tensor([t[0] for t in out.token_ids])
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert fit_pvalue(first, p1) > 1e-6 and fit_pvalue(second, p2) > 1e-6


def test_tree_building():
    accuracy = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    tree = tree_from_accuracies(accuracy, 5)
    assert tree == [(0,), (0, 0), (1,), (0, 1), (2,)]  # products .6 .24 .2 .12 .1 (then (0, 0, 0) .072)
    with pytest.raises(ValueError, match="recycling tree: path .1, 0. has no parent path"):
        sorted_tree([(0,), (1, 0)], "recycling")


def test_eval_only_recalibrates_the_tree(trained_heads, tiny_models, tiny_corpus, tmp_path, capsys):
    """`draftsman train medusa --config FILE --eval-only`: held-out agreement of existing heads,
    and the tree rebuilt under another node budget."""
    import yaml

    import shutil

    from draftsman.training.heads import main
    folder = shutil.copytree(trained_heads[0], tmp_path / "heads")  # the shared fixture stays as it is
    cfg = {"target": str(tiny_models["llama"][0]), "out": str(folder), "work_dir": str(tmp_path),
           "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no", "seq_len": 64,
           "eval_tokens": 256, "tree_budget": 4}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["medusa", "--config", str(tmp_path / "cfg.yaml"), "--eval-only"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["heldout_agreement"]["top1"]) == 3
    assert len(json.loads((folder / "config.json").read_text())["tree"]) == 4


def test_eval_only_runs_on_the_main_process_only(trained_heads, tiny_models, tiny_corpus, tmp_path, capsys,
                                                monkeypatch):
    """Under torchrun / accelerate launch the other processes leave the evaluation to the main one:
    each would otherwise rewrite the heads folder at once, and print its own report."""
    import shutil
    from types import SimpleNamespace

    import yaml

    from draftsman.training import heads as heads_training
    folder = shutil.copytree(trained_heads[0], tmp_path / "heads")
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    cfg = {"target": str(tiny_models["llama"][0]), "out": str(folder), "work_dir": str(tmp_path),
           "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no", "seq_len": 64,
           "eval_tokens": 256, "tree_budget": 4}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(heads_training, "accelerator", lambda mixed_precision: SimpleNamespace(
        is_main_process=False, device=torch.device("cpu"), autocast=contextlib.nullcontext))
    assert heads_training.main(["medusa", "--config", str(tmp_path / "cfg.yaml"), "--eval-only"]) == 0
    assert capsys.readouterr().out == ""
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before


def test_heads_sharing_the_target_lm_head(tiny_models, tiny_corpus, tmp_path):
    """share_lm_head: only the residual blocks train and are saved; drafting stays exact."""
    target_dir = str(tiny_models["llama"][0])
    cfg = {"target": target_dir, "out": str(tmp_path / "heads"), "work_dir": str(tmp_path / "work"),
           "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no", "num_heads": 3,
           "share_lm_head": True, "seq_len": 64, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2,
           "max_steps": 20, "eval_tokens": 256, "tree_budget": 6}
    metrics = train(cfg)
    assert metrics["curve"][-1][1] < metrics["curve"][0][1]
    target = load_for_reference(tiny_models["llama"][0])
    heads, config = MedusaHeads.load(tmp_path / "heads", target)
    assert config["share_lm_head"] and not any("lm_heads" in k for k in heads.state_dict())
    assert sum(p.numel() for p in heads.parameters()) == 3 * (64 * 64 + 64)
    prompts = [[5, 6, 7, 8], [1, 2, 3, 1, 2, 3]]
    plain = draftsman.load({"target": {"path": target_dir}}).generate(input_ids=prompts, max_new_tokens=20)
    dec = draftsman.load({"target": {"path": target_dir}, "drafter": {"name": "medusa", "path": str(tmp_path / "heads")}})
    assert dec.generate(input_ids=prompts, max_new_tokens=20).token_ids == plain.token_ids
