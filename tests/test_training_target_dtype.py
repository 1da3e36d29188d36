"""`target_dtype`: heads of every kind train on a target held in bfloat16 (half a 7B target's
memory), stay float32, load for the target in float32 and draft its own greedy output; they learn
what heads trained on the float32 target learn; bad values are named."""
import warnings

import pytest
import torch
from safetensors.torch import load_file

import draftsman
from draftsman.training import heads as heads_training

from test_training_steps import _heads_config
from tiny_models import load_for_reference

PROMPTS = [[5, 6, 7, 8], [1, 2, 3, 1, 2, 3]]
DRAFTER = {"medusa": "medusa", "eagle": "eagle", "mtp": "mtp", "eagle3": "eagle", "mlp_speculator": "mlp_speculator"}


def _train(tiny_models, tiny_corpus, tmp_path, out, **keys):
    cfg = _heads_config(tiny_models, tiny_corpus, tmp_path, out, ttt_steps=2, **keys)
    with warnings.catch_warnings():  # bfloat16 on a CPU without native bfloat16 math: slow, not wrong
        warnings.simplefilter("ignore")
        return heads_training.train(cfg)


def _weights(folder):
    tensors = load_file(folder / "model.safetensors")
    return torch.cat([tensors[k].double().flatten() for k in sorted(tensors) if tensors[k].is_floating_point()])


@pytest.mark.parametrize("kind,keys", [("medusa", {"share_lm_head": True}), ("eagle", {}), ("mtp", {}),
                                       ("eagle3", {}), ("mlp_speculator", {})])
def test_heads_train_on_a_bfloat16_target(kind, keys, tiny_models, tiny_corpus, tmp_path, monkeypatch):
    held = []
    load = heads_training.pretrained_text_model

    def recorded(folder, dtype, what="model"):
        model = load(folder, dtype, what)
        held.append(model.dtype)
        return model

    monkeypatch.setattr(heads_training, "pretrained_text_model", recorded)
    _train(tiny_models, tiny_corpus, tmp_path, "half", kind=kind, target_dtype="bfloat16", **keys)
    monkeypatch.setattr(heads_training, "pretrained_text_model", load)
    _train(tiny_models, tiny_corpus, tmp_path, "full", kind=kind, **keys)
    _train(tiny_models, tiny_corpus, tmp_path, "start", kind=kind, max_steps=0, **keys)
    assert held == [torch.bfloat16]
    # The same 3 steps on hidden states that differ by bfloat16 rounding end close together, closer
    # than half the way they moved: Adam's steps follow the gradient's signs, and most signs agree.
    half, full, start = (_weights(tmp_path / out) for out in ("half", "full", "start"))
    assert (half - full).norm() < 0.5 * (full - start).norm()  # 0.18-0.30 measured; unrelated steps: ~1.4
    target = {"path": str(tiny_models["llama"][0])}
    plain = draftsman.load({"target": target}).generate(input_ids=PROMPTS, max_new_tokens=16).token_ids
    dec = draftsman.load({"target": target, "drafter": {"name": DRAFTER[kind], "path": str(tmp_path / "half")}})
    assert dec.generate(input_ids=PROMPTS, max_new_tokens=16).token_ids == plain


def test_a_bad_target_dtype_is_named(tiny_models):
    with pytest.raises(ValueError, match=r"target_dtype must be one of \['bfloat16', .*'auto'\], got 'half'"):
        heads_training.load_config({"target": str(tiny_models["llama"][0]), "out": "x", "target_dtype": "half"})


@pytest.mark.parametrize("kind", ["medusa", "eagle", "mtp", "eagle3", "mlp_speculator"])
def test_heads_loaded_for_a_bfloat16_target_train_in_float32(kind, tiny_models, fresh_heads):
    """init_from and --eval-only load saved heads beside the bfloat16 target: every parameter
    comes back float32, and an eagle / mtp head reads out through a float32 LM head."""
    target = load_for_reference(tiny_models["llama"][0]).to(torch.bfloat16)
    heads = heads_training.load_heads({"kind": kind}, fresh_heads / kind, target)
    assert {p.dtype for p in heads.parameters()} == {torch.float32}
    if kind in ("eagle", "mtp"):
        assert heads.body.get_output_embeddings().weight.dtype == torch.float32
        assert target.get_output_embeddings().weight.dtype == torch.bfloat16  # the target's own is untouched
