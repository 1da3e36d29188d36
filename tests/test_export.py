"""`draftsman export`: the written key set is exactly what the engine loads (no key missing, none
extra), shapes follow the target, and the exported tensors rebuilt into a plain model compute what
the trained module computes."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from draftsman.cli import main
from draftsman.export import expected_keys, export
from draftsman.heads.feature_head import FeatureHead
from draftsman.heads.medusa import MedusaHeads

from tiny_models import load_for_reference


def _read(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"][0], load_for_reference(tiny_models["llama"][0])


@pytest.fixture(scope="module")
def eagle_heads(llama, tmp_path_factory):
    folder, target = llama
    torch.manual_seed(0)
    head = FeatureHead.for_target(target, "eagle")
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # not the copied init: a head with its own weights
    out = tmp_path_factory.mktemp("eagle")
    head.save(out, target, dtype=torch.float32)
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle_export_has_the_exact_layout_and_computes_the_same(llama, eagle_heads, tmp_path, engine):
    folder, target = llama
    out = export("eagle", str(eagle_heads), str(folder), engine, str(tmp_path / engine), dtype="float32")
    tensors = _read(out / "model.safetensors")
    assert set(tensors) == expected_keys("eagle", engine)
    config = json.loads((out / "config.json").read_text())
    d = target.config.hidden_size
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == target.config.vocab_size
    assert config["architectures"] == [{"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]]
    assert tensors["fc.weight"].shape == (d, 2 * d)
    assert not any("input_layernorm" in k or k.startswith(("norm", "lm_head", "embed")) for k in tensors)
    # Rebuild as the engines do: fc over [embedding; hidden], one Llama layer with no input norm,
    # the target's LM head. Compare with our module on random features.
    layer_model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    layer_model.model.layers[0].input_layernorm = torch.nn.Identity()
    layer_model.model.norm = torch.nn.Identity()
    layer_model.load_state_dict({f"model.{k}": v for k, v in tensors.items() if k.startswith("layers.")}, strict=False)
    layer_model.lm_head = target.lm_head
    fc = torch.nn.Linear(2 * d, d, bias=engine == "sglang")
    fc.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("fc.")})
    head, _ = FeatureHead.load(eagle_heads, target)
    features, tokens = torch.randn(2, 6, d), torch.randint(0, target.config.vocab_size, (2, 6))
    with torch.no_grad():
        fused = fc(torch.cat([target.model.embed_tokens(tokens), features], -1))
        rebuilt = layer_model(inputs_embeds=fused).logits
        ours = head(features, tokens)[1]
    torch.testing.assert_close(rebuilt, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("engine", ["vllm", "medusa"])
def test_medusa_export_has_the_exact_layout(llama, tmp_path, engine, share):
    folder, target = llama
    heads = MedusaHeads.for_target(target, num_heads=3, num_layers=1, share_lm_head=share)
    heads.save(tmp_path / "heads", target, dtype=torch.float32)
    out = export("medusa", str(tmp_path / "heads"), str(folder), engine, str(tmp_path / "out"), dtype="float32")
    name = "model.safetensors" if engine == "vllm" else "medusa_lm_head.safetensors"
    tensors = _read(out / name)
    config = json.loads((out / "config.json").read_text())
    assert set(tensors) == expected_keys("medusa", engine, num_heads=3, num_layers=1)
    projection = tensors["lm_heads.2.weight" if engine == "vllm" else "2.1.weight"]
    torch.testing.assert_close(projection, target.lm_head.weight)  # zero-init blocks: heads = LM head
    if engine == "vllm":
        assert config == {"model_type": "medusa", "hidden_size": target.config.hidden_size,
                          "vocab_size": target.config.vocab_size, "num_heads": 3, "num_hidden_layers": 1,
                          "medusa_fc_bias": True}
    else:
        assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1


def test_what_cannot_be_exported_is_refused_with_a_reason(llama, tiny_models, tmp_path, capsys):
    folder, target = llama
    with pytest.raises(ValueError, match="MTP module has input norms"):
        export("mtp", "x", str(folder), "vllm", str(tmp_path))
    with pytest.raises(ValueError, match=r"export to engines \['vllm', 'sglang'\]"):
        export("eagle", "x", str(folder), "tgi", str(tmp_path))
    qwen = load_for_reference(tiny_models["qwen2"][0])
    FeatureHead.for_target(qwen, "eagle").save(tmp_path / "q", qwen)
    with pytest.raises(ValueError, match="supports Llama targets"):
        export("eagle", str(tmp_path / "q"), str(tiny_models["qwen2"][0]), "vllm", str(tmp_path / "o"))
    code = main(["export", "eagle", "--heads", str(tmp_path / "q"), "--target", str(folder), "--engine", "vllm",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "trained for another target" in capsys.readouterr().err
