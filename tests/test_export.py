"""`draftsman export`: the written key set is exactly what the engine loads (no key missing, none
extra), shapes follow the target, and the exported tensors rebuilt into a plain model compute what
the trained module computes."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from draftsman import export as export_module
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


def _small_target(arch: str, folder) -> torch.nn.Module:
    """A 4-layer random target of `arch`, saved to `folder` (layers 1-3 are what the engines can
    fuse for EAGLE-3). Mistral's has a sliding window and a head_dim that is not hidden / heads;
    Qwen2's has q/k/v biases; Qwen3's q/k norms, so its heads export with `layer: llama` only."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        target = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        target = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif arch == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, rope_theta=1e6, tie_word_embeddings=False))
    else:
        target = MistralForCausalLM(MistralConfig(**common, head_dim=16, sliding_window=4))
    target.eval().save_pretrained(folder)
    return target


def _perturbed(head):
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))  # not the copied init: a head with its own weights
    return head


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_eagle_export_has_the_exact_layout_and_computes_the_same(arch, engine, tmp_path):
    """Qwen3's head has `layer: llama`; the others a layer of the target's class."""
    target = _small_target(arch, tmp_path / "target")
    layer = "llama" if arch == "qwen3" else "target"
    _perturbed(FeatureHead.for_target(target, "eagle", layer=layer)).save(tmp_path / "heads", target,
                                                                          dtype=torch.float32)
    out = export("eagle", str(tmp_path / "heads"), str(tmp_path / "target"), engine, str(tmp_path / engine),
                 dtype="float32")
    tensors = _read(out / "model.safetensors")
    biased = arch == "qwen2"
    assert set(tensors) == expected_keys("eagle", engine, attention_bias=biased)
    config = json.loads((out / "config.json").read_text())
    d = target.config.hidden_size
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == target.config.vocab_size
    assert config["architectures"] == [{"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}[engine]]
    assert config["model_type"] == "llama" and config["attention_bias"] == biased
    assert config["head_dim"] == (16 if arch == "mistral" else 8) and "sliding_window" not in config
    assert tensors["fc.weight"].shape == (d, 2 * d)
    assert not any("input_layernorm" in k or k.startswith(("norm", "lm_head", "embed")) for k in tensors)
    if biased:  # the engines' Llama layer takes an o_proj bias with the others: Qwen2 has none
        assert not tensors["layers.0.self_attn.o_proj.bias"].any() and tensors["layers.0.self_attn.q_proj.bias"].any()
    # Rebuild as the engines do: fc over [embedding; hidden], one Llama layer with no input norm,
    # the target's LM head. Compare with our module on random features.
    layer_model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    layer_model.model.layers[0].input_layernorm = torch.nn.Identity()
    layer_model.model.norm = torch.nn.Identity()
    missing = layer_model.load_state_dict({f"model.{k}": v for k, v in tensors.items() if k.startswith("layers.")},
                                          strict=False).missing_keys
    assert all(k.startswith(("model.embed", "lm_head")) for k in missing)
    layer_model.lm_head = target.lm_head
    fc = torch.nn.Linear(2 * d, d, bias=engine == "sglang")
    fc.load_state_dict({k[3:]: v for k, v in tensors.items() if k.startswith("fc.")})
    head, _ = FeatureHead.load(tmp_path / "heads", target)
    features, tokens = torch.randn(2, 9, d), torch.randint(0, target.config.vocab_size, (2, 9))
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


def test_an_interrupted_export_leaves_the_last_one_whole(llama, tmp_path, monkeypatch):
    """Ctrl-C while the weights are written: the earlier export's config and weights stay, with no
    partial file beside them for an engine to load."""
    folder, target = llama
    for heads_count in (2, 3):
        heads = MedusaHeads.for_target(target, num_heads=heads_count, num_layers=1)
        heads.save(tmp_path / f"heads{heads_count}", target, dtype=torch.float32)
    out = tmp_path / "out"
    export("medusa", str(tmp_path / "heads2"), str(folder), "vllm", str(out), dtype="float32")

    def interrupted(tensors, path, *args, **kwargs):
        open(path, "wb").write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export("medusa", str(tmp_path / "heads3"), str(folder), "vllm", str(out), dtype="float32")
    assert sorted(p.name for p in out.iterdir()) == [".draftsman-export.json", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2
    assert set(_read(out / "model.safetensors")) == expected_keys("medusa", "vllm", num_heads=2, num_layers=1)



def test_out_must_not_be_the_heads_the_target_or_any_model(llama, tmp_path):
    """--out pointed at the heads folder (or the target's) overwrote its config.json and weights with
    the engine's layout: the heads it exported were gone. Now only a new folder or an earlier export
    is written into; nothing else is touched."""
    folder, target = llama
    heads = tmp_path / "heads"
    MedusaHeads.for_target(target, num_heads=2, num_layers=1).save(heads, target, dtype=torch.float32)
    other = tmp_path / "other-model"
    other.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (other / name).write_text("{}")
    (tmp_path / "a-file").write_text("")
    not_json = tmp_path / "not-json"
    not_json.mkdir()
    (not_json / "config.json").write_text("{no")
    not_object = tmp_path / "not-an-object"
    not_object.mkdir()
    (not_object / "config.json").write_text("[1, 2]")
    before = {p: p.read_bytes() for d in (heads, Path(folder), other, not_json, not_object) for p in d.iterdir()}
    for out, named in ((heads, "is the --heads folder"), (heads / ".." / "heads", "is the --heads folder"),
                       (Path(folder), "is the --target folder"),
                       (other, r"holds files an export does not write \(tokenizer.json\)"),
                       (tmp_path / "a-file", "is a file"), (not_json, "holds a config.json no export wrote"),
                       (not_object, "holds a config.json no export wrote")):
        with pytest.raises(ValueError, match=named):
            export("medusa", str(heads), str(folder), "vllm", str(out), dtype="float32")
    copy = tmp_path / "copy-of-heads"  # draftsman heads elsewhere: config.json and weights alone
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((heads / name).read_bytes())
    with pytest.raises(ValueError, match=r"holds draftsman heads \(its config.json has a 'kind'\)"):
        export("medusa", str(heads), str(folder), "vllm", str(copy), dtype="float32")
    bare = tmp_path / "bare-model"  # a model's config.json and weights alone were written over, exit 0
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((Path(folder) / name).read_bytes())
    before.update({p: p.read_bytes() for p in bare.iterdir()})
    with pytest.raises(ValueError, match=r"holds config.json and model.safetensors without the .draftsman-export"):
        export("medusa", str(heads), str(folder), "vllm", str(bare), dtype="float32")
    assert {p: p.read_bytes() for p in before} == before
    out = tmp_path / "new" / "export"
    for engine, weights in (("vllm", "model.safetensors"), ("medusa", "medusa_lm_head.safetensors"),
                            ("vllm", "model.safetensors")):  # an earlier export, of either engine, is written over
        export("medusa", str(heads), str(folder), engine, str(out), dtype="float32")
        assert sorted(p.name for p in out.iterdir()) == sorted([".draftsman-export.json", "config.json", weights])
    assert json.loads((out / "config.json").read_text())["num_heads"] == 2
    assert json.loads((out / ".draftsman-export.json").read_text())["engine"] == "vllm"
    refused = tmp_path / "refused"  # heads of another kind: refused, and no empty --out left behind
    with pytest.raises(ValueError):
        export("eagle", str(heads), str(folder), "vllm", str(refused), dtype="float32")
    assert not refused.exists()

def test_what_cannot_be_exported_is_refused_with_a_reason(llama, tiny_models, tmp_path, capsys, monkeypatch):
    folder, target = llama
    with pytest.raises(ValueError, match="MTP heads are not exported: .* normalises both inputs"):
        export("mtp", "x", str(folder), "vllm", str(tmp_path))
    with pytest.raises(ValueError, match=r"export to engines \['vllm', 'sglang'\]"):
        export("eagle", "x", str(folder), "tgi", str(tmp_path))
    gpt2 = load_for_reference(tiny_models["gpt2"][0])
    FeatureHead.for_target(gpt2, "eagle").save(tmp_path / "g", gpt2)
    with pytest.raises(ValueError, match="this head.s layer is a GPT2LMHeadModel layer.*layer: llama"):
        export("eagle", str(tmp_path / "g"), str(tiny_models["gpt2"][0]), "vllm", str(tmp_path / "o"))
    qwen = _small_target("qwen2", tmp_path / "qwen")
    FeatureHead.for_target(qwen, "eagle3").save(tmp_path / "q3", qwen)
    with pytest.raises(ValueError, match="q/k/v biases .* SGLang's EAGLE-3 layer has none.*--engine vllm"):
        export("eagle", str(tmp_path / "q3"), str(tmp_path / "qwen"), "sglang", str(tmp_path / "o"))
    # The safety net under the list of targets: a layer with parts a Llama layer lacks (Qwen3's
    # q/k norms) is refused by name even where its class were listed.
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    qwen3.save_pretrained(tmp_path / "qwen3")
    FeatureHead.for_target(qwen3, "eagle").save(tmp_path / "q3e", qwen3)
    monkeypatch.setattr(export_module, "_LLAMA_LAYER_TARGETS", ("Qwen3ForCausalLM",))
    with pytest.raises(ValueError, match=r"layer has \['self_attn.k_norm.weight', 'self_attn.q_norm.weight'\]"):
        export("eagle", str(tmp_path / "q3e"), str(tmp_path / "qwen3"), "vllm", str(tmp_path / "o"))
    monkeypatch.undo()
    code = main(["export", "eagle", "--heads", str(tmp_path / "g"), "--target", str(folder), "--engine", "vllm",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "trained for another target" in capsys.readouterr().err
    # An EAGLE-3 head of a 2-layer target fuses hidden_states 0, 1, 2: the embedding output and the
    # normed top state have no number in the engines' layer ids.
    FeatureHead.for_target(target, "eagle3").save(tmp_path / "e3", target)
    with pytest.raises(ValueError, match=r"fuses hidden_states \[0, 1, 2\]; engines read the inputs of layers 1..1"):
        export("eagle", str(tmp_path / "e3"), str(folder), "sglang", str(tmp_path / "o3"))


@pytest.mark.parametrize("kind, said", [
    ("mtp", ["MTP heads are not exported", "EAGLE-1 layout cannot hold", "train an `eagle` head"]),
    ("mlp_speculator", ["MLP speculators need no export", "fms-extras' own MLPSpeculator layout"]),
])
def test_export_of_heads_that_are_not_exported_says_why_and_how_to_serve_them(llama, tmp_path, capsys, kind, said):
    """`draftsman export mtp` (and mlp_speculator) stopped at argparse ("invalid choice"), never
    reaching the reason: an MTP module has no engine layout, an MLP speculator is already in its own."""
    folder, _ = llama
    out = tmp_path / "out"
    code = main(["export", kind, "--heads", str(tmp_path / "heads"), "--target", str(folder),
                 "--engine", "vllm", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "invalid choice" not in err
    assert all(words in err for words in said), err
    assert f"drafter: {{name: {kind}, path: {tmp_path / 'heads'}}}" in err
    assert not out.exists()


def test_a_model_given_as_heads_is_named_as_heads_not_drafter_path(llama, tmp_path, capsys):
    """--heads pointed at the target (or at an MLP speculator) was refused in the drafter's words:
    "point drafter.path at a heads folder ... drafts as drafter draft_model"."""
    folder, _ = llama
    code = main(["export", "eagle", "--heads", str(folder), "--target", str(folder), "--engine", "vllm",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"--heads '{folder}' holds a 'llama' model, not eagle heads" in err
    assert "draftsman train eagle" in err and "drafter.path" not in err and "draft_model" not in err
    spec = tmp_path / "spec"  # what `draftsman train mlp_speculator` writes holds no 'kind'
    spec.mkdir()
    (spec / "config.json").write_text(json.dumps({"model_type": "mlp_speculator", "n_predict": 2}))
    for kind in ("eagle", "medusa"):
        with pytest.raises(ValueError, match=r"holds an MLP speculator, not \w+ heads. MLP speculators need no "
                                             r"export.*vLLM's MLPSpeculator model reads"):
            export(kind, str(spec), str(folder), "vllm", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_paths_written_by_an_export_resolve_from_anywhere(llama, tmp_path, monkeypatch):
    """The Medusa repo's base_model_name_or_path (and the export mark's paths) were written as typed:
    a relative --target resolved only from the folder the export ran in."""
    folder, target = llama
    MedusaHeads.for_target(target, num_heads=2, num_layers=1).save(tmp_path / "heads", target, dtype=torch.float32)
    monkeypatch.chdir(tmp_path)
    out = export("medusa", "heads", os.path.relpath(folder), "medusa", "out", dtype="float32")
    monkeypatch.chdir(Path(folder).parent)  # where an engine might run: elsewhere
    config = json.loads((tmp_path / out / "config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(folder).resolve())
    mark = json.loads((tmp_path / out / ".draftsman-export.json").read_text())
    assert mark["target"] == str(Path(folder).resolve())
    assert mark["heads"] == str((tmp_path / "heads").resolve())


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _eagle3_by_hand(t: dict, config: dict, embeddings, aux):
    """EAGLE-3's draft step written from the exported tensors alone, as the engines compute it:
    fc over [low; mid; high], attention over [input_layernorm(embedding); hidden_norm(h)] with the
    residual h, MLP, norm, LM head over the draft vocabulary. One causal sequence, Llama RoPE."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    eps, heads, kv, hd = (config[k] for k in ("rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim"))
    L = embeddings.shape[1]

    def proj(x, name):  # with the bias the config's attention_bias asks for
        out = x @ t[f"midlayer.self_attn.{name}.weight"].T
        return out + t[f"midlayer.self_attn.{name}.bias"] if config["attention_bias"] else out

    h = aux @ t["fc.weight"].T
    x = torch.cat([_rms(embeddings, t["midlayer.input_layernorm.weight"], eps),
                   _rms(h, t["midlayer.hidden_norm.weight"], eps)], -1)
    q = proj(x, "q_proj").view(1, L, heads, hd).transpose(1, 2)
    k = proj(x, "k_proj").view(1, L, kv, hd).transpose(1, 2)
    v = proj(x, "v_proj").view(1, L, kv, hd).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))(
        x, torch.arange(L)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, L, heads * hd)
    h = h + proj(attended, "o_proj")
    m = _rms(h, t["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return _rms(h, t["norm.weight"], eps) @ t["lm_head.weight"].T


@pytest.mark.parametrize("engine,arch", [("vllm", "llama"), ("sglang", "llama"), ("vllm", "mistral"),
                                         ("sglang", "mistral"), ("vllm", "qwen2"), ("vllm", "qwen3"),
                                         ("sglang", "qwen3")])
def test_eagle3_export_has_the_exact_layout_and_computes_the_same(tmp_path, engine, arch):
    """The head's draft vocabulary is 40 scattered token ids, so d2t / t2d are not trivial. Qwen3's
    head has `layer: llama` (its RoPE base, 1e6, must reach the exported config).
    (A Qwen2 head to SGLang is refused: test_what_cannot_be_exported_is_refused_with_a_reason.)"""
    target = _small_target(arch, tmp_path / "target")
    ids = torch.randperm(96)[:40].sort().values
    layer = "llama" if arch == "qwen3" else "target"
    head = _perturbed(FeatureHead.for_target(target, "eagle3", ids.tolist(), layer=layer))
    head.save(tmp_path / "heads", target, dtype=torch.float32)
    out = export("eagle", str(tmp_path / "heads"), str(tmp_path / "target"), engine, str(tmp_path / engine),
                 dtype="float32")
    tensors = _read(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert set(tensors) == expected_keys("eagle3", engine, attention_bias=arch == "qwen2")
    assert config["attention_bias"] == (arch == "qwen2") and "sliding_window" not in config
    assert config["rope_parameters"]["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == 96 and not config["tie_word_embeddings"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: layer inputs
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: layer outputs
    assert tensors["fc.weight"].shape == (32, 96) and tensors["lm_head.weight"].shape == (40, 32)
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (96,)
    assert torch.equal(torch.arange(40) + d2t, ids) and torch.equal(t2d.nonzero()[:, 0], ids)
    tokens = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        states = target(input_ids=tokens, output_hidden_states=True).hidden_states
        aux = torch.cat([states[k] for k in head.config.aux_layers], -1)
        ours = head(aux, tokens)[1]
        by_hand = _eagle3_by_hand(tensors, config, target.model.embed_tokens(tokens), aux)
    torch.testing.assert_close(by_hand, ours, atol=1e-4, rtol=1e-4)
