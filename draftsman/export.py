"""`draftsman export`: trained heads in the checkpoint layouts serving engines load.

    draftsman export eagle  --heads zoo/python-eagle  --target zoo/python-target --engine vllm   --out DIR
    draftsman export eagle  --heads zoo/python-eagle3 --target zoo/python-target --engine sglang --out DIR
    draftsman export medusa --heads zoo/python-medusa --target zoo/python-target --engine vllm   --out DIR

What each engine expects is written once, in `expected_keys` below, from vLLM's and SGLang's loaders as read in late 2026 (EAGLE-1/2: vLLM method
"eagle", SGLang --speculative-algorithm EAGLE; Medusa: vLLM method "medusa" and the Medusa repo's
own file; EAGLE-3: vLLM method "eagle3", SGLang EAGLE3, one layout for both). `export eagle`
writes whichever EAGLE generation the heads folder holds. The exporter writes exactly that key set, and refuses what it cannot represent: an MTP
module (its input norms and final norm have no place in the EAGLE-1 layout, and no engine loads a
standalone MTP module for Llama-family targets) and EAGLE heads whose layer is not a Llama layer.
MLP speculators need no export (already in fms-extras' layout): `export mlp_speculator` says so.

Both engines serve an EAGLE head's layer as a Llama layer. A head trained with `layer: llama` has
one, whatever its target; a head's layer of the target's own class exports where that class's
layer *is* a Llama layer: Llama, Mistral, and Qwen2, whose q/k/v biases the engines' Llama layer
takes when the config sets `attention_bias` (it then wants an o_proj bias as well: a zero one is
written). SGLang's EAGLE-3 layer builds q/k/v without biases and drops them silently, so a Qwen2
EAGLE-3 head exports to vLLM only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .atomic_files import replaced_together
from .config import read_json_object
from .export_flags import ENGINES, add_arguments  # noqa: F401 (draftsman.export's own names, as before)
from .models import load_causal_lm
_LLAMA_LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "post_attention_layernorm.weight"]


_EAGLE3_MIDLAYER = _LLAMA_LAYER + ["input_layernorm.weight", "hidden_norm.weight"]
_ATTENTION_BIASES = [f"self_attn.{p}_proj.bias" for p in "qkvo"]
# Target classes whose decoder layer computes what the engines' Llama layer computes.
_LLAMA_LAYER_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Keys of the target's config that describe its layers' attention pattern; a head's one layer
# attends to its whole context (heads/feature_head.py), so none of them describes it.
_WINDOW_KEYS = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")
# What an export writes (any engine's); an --out folder holding anything else is not an earlier export.
_EXPORT_FILES = {"config.json", "model.safetensors", "medusa_lm_head.safetensors"}
# Written beside every export (the engines read only config.json and the weights): an export is
# written only into a new folder or an earlier export's, and a model's config.json and weights look
# like an export's.
EXPORT_MARK = ".draftsman-export.json"


def expected_keys(kind: str, engine: str, num_heads: int = 0, num_layers: int = 0,
                  attention_bias: bool = False) -> set[str]:
    """The exact key set an engine loads for these heads (Medusa: for this many heads and layers).
    kind eagle3: an EAGLE-3 head, exported by `export eagle`. attention_bias: the layer has q/k/v/o
    biases (config `attention_bias`)."""
    layer = (_EAGLE3_MIDLAYER if kind == "eagle3" else _LLAMA_LAYER) + (_ATTENTION_BIASES if attention_bias else [])
    if kind == "eagle3":
        return {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"midlayer.{k}" for k in layer}
    if kind == "eagle":
        keys = {"fc.weight"} | {f"layers.0.{k}" for k in layer}
        return keys | {"fc.bias"} if engine == "sglang" else keys
    H, L = num_heads, num_layers
    if engine == "vllm":
        return ({f"blocks.{h}.layers.{l}.{p}" for h in range(H) for l in range(L) for p in ("weight", "bias")}
                | {f"lm_heads.{h}.weight" for h in range(H)})
    return ({f"{h}.{l}.linear.{p}" for h in range(H) for l in range(L) for p in ("weight", "bias")}
            | {f"{h}.{L}.weight" for h in range(H)})


def export(kind: str, heads_dir: str, target_dir: str, engine: str, out: str, dtype: str = "bfloat16") -> Path:
    if kind == "mtp":
        raise ValueError(
            "MTP heads are not exported: vLLM and SGLang load MTP modules only for model families that ship them "
            "(DeepSeek, MiMo, ...), and the EAGLE-1 layout cannot hold an MTP module: it normalises both inputs "
            "before fc, keeps its layer's input norm and reads out through a final norm, none of which that layout "
            "has (left out, the engine would draft from another function). Serve the MTP heads with draftsman "
            f"(`drafter: {{name: mtp, path: {heads_dir}}}` in the config of `draftsman serve --config`), "
            "or train an `eagle` head (`draftsman train eagle`) and export that")
    if kind == "mlp_speculator":
        raise ValueError(_MLP_SPECULATOR_NEEDS_NO_EXPORT.format(heads=heads_dir))
    if kind not in ENGINES:
        raise ValueError(f"cannot export {kind!r} heads: exportable kinds are {sorted(ENGINES)}")
    if engine not in ENGINES[kind]:
        raise ValueError(f"{kind} heads export to engines {list(ENGINES[kind])}, not {engine!r}")
    check_heads_folder(heads_dir, kind)
    out_dir = Path(out)
    check_out_folder(out_dir, heads_dir, target_dir)
    # Recorded in what is written (the Medusa repo's base_model_name_or_path, the export mark): a
    # relative path would resolve only from the folder the export was run in.
    heads_path, target_path = (str(Path(p).expanduser().resolve()) for p in (heads_dir, target_dir))
    target = load_causal_lm(target_dir, "float32", "cpu", what="--target")
    cast = getattr(torch, dtype)
    if kind == "eagle":
        tensors, config, filename, generation = _eagle(heads_dir, target, engine)
        expected = expected_keys(generation, engine, attention_bias=config.get("attention_bias", False))
    else:
        tensors, config, filename, sizes = _medusa(heads_dir, target, engine, target_path)
        expected = expected_keys(kind, engine, *sizes)
    missing = expected ^ set(tensors)
    if missing:  # a bug in this file, not bad input
        raise RuntimeError(f"export wrote keys that differ from expected_keys: {sorted(missing)}")
    out_dir.mkdir(parents=True, exist_ok=True)  # (only now: a refused export leaves no empty folder)
    # All written before any replaces an earlier export's: Ctrl-C leaves no half file for an engine to load.
    with replaced_together([out_dir / filename, out_dir / "config.json", out_dir / EXPORT_MARK],
                           mode=0o644) as (weights, config_file, mark):
        save_file({k: (v.to(cast) if v.is_floating_point() else v).detach().contiguous() for k, v in tensors.items()},
                  str(weights))
        config_file.write_text(json.dumps(config, indent=2))
        mark.write_text(json.dumps({"kind": kind, "engine": engine, "heads": heads_path, "target": target_path},
                                   indent=2))
    for stale in _EXPORT_FILES - {filename, "config.json"}:  # the other engine's weights, from an earlier export
        (out_dir / stale).unlink(missing_ok=True)
    return out_dir


_MLP_SPECULATOR_NEEDS_NO_EXPORT = (
    "MLP speculators need no export: `draftsman train mlp_speculator` writes fms-extras' own MLPSpeculator layout "
    "(config.json with model_type mlp_speculator; tensors emb.i, proj.i, head.i, ln.i), the one IBM's released "
    "speculators use and vLLM's MLPSpeculator model reads, so '{heads}' is already what an engine loads (the "
    "target fingerprint in its config.json is ignored there). vLLM's V1 engine does not route the method "
    "(vllm-project/vllm#47825, July 2026): serve it with draftsman (`drafter: {{name: mlp_speculator, path: "
    "{heads}}}` in the config of `draftsman serve --config`)")


def check_heads_folder(heads_dir: str, kind: str) -> None:
    """Refuse a --heads folder that holds a model (the target's, a released speculator's) in words
    for export: load_checkpoint's own message is the drafter's (drafter.path, draft_model)."""
    config_file = Path(heads_dir).expanduser() / "config.json"
    config = read_json_object(config_file) if config_file.is_file() else None
    if not config or "kind" in config or "model_type" not in config:
        return  # heads, or no config.json: the heads loader names what is wrong
    if config["model_type"] == "mlp_speculator":
        raise ValueError(f"--heads '{heads_dir}' holds an MLP speculator, not {kind} heads. "
                         + _MLP_SPECULATOR_NEEDS_NO_EXPORT.format(heads=heads_dir))
    raise ValueError(f"--heads '{heads_dir}' holds a {config['model_type']!r} model, not {kind} heads: give --heads "
                     f"the folder `draftsman train {kind}` wrote (the model they were trained for goes to --target)")


def check_out_folder(out_dir: Path, heads_dir: str, target_dir: str) -> None:
    """The export replaces config.json and the weights in --out: that is fine for a new folder or an
    earlier export, and would destroy the heads or the target (or any model) it is pointed at."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file: give a folder to write config.json and the weights into")
    for given, what in ((heads_dir, "--heads"), (target_dir, "--target")):
        if out_dir.resolve() == Path(given).resolve():
            raise ValueError(f"--out {out_dir} is the {what} folder: the export would overwrite its config.json and "
                             "weights; give a new folder")
    if not out_dir.is_dir() or (out_dir / EXPORT_MARK).is_file():  # a new folder, or an earlier export's
        return
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in _EXPORT_FILES and not p.name.startswith("."))
    config_file = out_dir / "config.json"
    config = read_json_object(config_file) if config_file.exists() else {}
    ours = sorted(p.name for p in out_dir.iterdir() if p.name in _EXPORT_FILES)
    found = ("a config.json no export wrote" if config is None
             else "draftsman heads (its config.json has a 'kind')" if "kind" in config
             else f"files an export does not write ({', '.join(others[:4])})" if others
             else f"{' and '.join(ours)} without the {EXPORT_MARK} an export leaves (a model's, or an export made "
                  "before exports left one: delete it to export there)" if ours else None)
    if found:
        raise ValueError(f"--out {out_dir} holds {found}: the export would replace its config.json and weights. "
                         "Give a new folder, or an earlier export's")


def _eagle(heads_dir, target, engine):
    from .heads.feature_head import FeatureHead

    head, saved = FeatureHead.load(heads_dir, target, kind=("eagle", "eagle3"))
    if type(head.body).__name__ not in _LLAMA_LAYER_TARGETS:
        raise ValueError(f"this head's layer is a {type(target).__name__} layer, and the engines serve an EAGLE head "
                         f"as a Llama layer: only the layers of {', '.join(_LLAMA_LAYER_TARGETS)} are one. "
                         "Train the head with `layer: llama` (a Llama layer of the target's sizes) to export it, "
                         "or serve it with draftsman")
    state = head.state_dict()
    if head.config.kind == "eagle3":
        return (*_eagle3(head, state, target, engine), "model.safetensors", "eagle3")
    tensors = {"fc.weight": state["fuse.weight"]}
    tensors.update({f"layers.0.{k}": v for k, v in _layer_tensors(state, _LLAMA_LAYER, target).items()})
    if engine == "sglang":  # SGLang's fc has a bias (left random if absent); ours is trained without one
        tensors["fc.bias"] = torch.zeros(head.config.hidden_size)
    config = _llama_config(head, tensors, "layers.0.", architectures=[
        "LlamaForCausalLM" if engine == "vllm" else "LlamaForCausalLMEagle"])
    return tensors, config, "model.safetensors", "eagle"


def _layer_tensors(state: dict, names: list[str], target) -> dict:
    """The head's decoder layer under Llama's names; q/k/v biases (Qwen2) come with an o_proj
    bias, zero when the layer has none, since the engines' Llama layer takes all four or none.
    Anything else in the layer has no place in the layout and is refused."""
    prefix = "parts.layers.0."
    layer = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    out = {k: layer.pop(k) for k in names}
    if "self_attn.q_proj.bias" in layer:
        zero = torch.zeros(target.config.hidden_size, dtype=out["self_attn.o_proj.weight"].dtype)
        out.update({k: layer.pop(k, zero) for k in _ATTENTION_BIASES})
    if layer:
        raise ValueError(f"this head's layer has {sorted(layer)}, which the engines' Llama layer does not: "
                         "it cannot be exported")
    return out


def _llama_config(head, tensors: dict, layer_prefix: str, **changes) -> dict:
    """The head's layer's config (the target's, one layer) as the Llama config the engines read."""
    body = head.body.config
    config = body.to_dict()
    for key in ("dtype",) + _WINDOW_KEYS:
        config.pop(key, None)
    config.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                  # SGLang reads head_dim with a default only when the key is absent, not null
                  head_dim=getattr(body, "head_dim", None) or body.hidden_size // body.num_attention_heads,
                  attention_bias=f"{layer_prefix}self_attn.q_proj.bias" in tensors, **changes)
    return config


def _eagle3(head, state, target, engine):
    """EAGLE-3 layout, the same file for vLLM and SGLang: midlayer.*, norm, lm_head over the draft
    vocabulary, d2t (target id = i + d2t[i]) and t2d (which target ids are in the draft vocabulary)."""
    n = target.config.num_hidden_layers
    aux = head.config.aux_layers
    if not all(1 <= k <= n - 1 for k in aux):
        raise ValueError(f"this EAGLE-3 head fuses hidden_states {aux}; engines read the inputs of layers "
                         f"1..{n - 1} only (0 is the embedding, {n} the normed top state): retrain with aux_layers "
                         "inside that range")
    tensors = {"fc.weight": state["fuse.weight"], "norm.weight": state["readout.norm.weight"],
               "lm_head.weight": state["readout.lm_head.weight"]}
    tensors.update({f"midlayer.{k}": v for k, v in _layer_tensors(state, _EAGLE3_MIDLAYER, target).items()})
    if engine == "sglang" and "midlayer.self_attn.q_proj.bias" in tensors:
        raise ValueError("this EAGLE-3 head's layer has q/k/v biases (a Qwen2 target's layer), and SGLang's EAGLE-3 "
                         "layer has none: it would drop them without a word and draft from another layer. "
                         "Export it with --engine vllm, whose EAGLE-3 layer takes them")
    ids = head.draft_token_ids.long().cpu()
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros(head.config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    config = _llama_config(head, tensors, "midlayer.", architectures=["LlamaForCausalLMEagle3"],
                           draft_vocab_size=len(ids),
                           # vLLM: indices of the layers whose *input* is fused; SGLang: of the layers
                           # whose *output* is fused (one less): both name the same states.
                           eagle_aux_hidden_state_layer_ids=list(aux),
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in aux]})
    return tensors, config


def _medusa(heads_dir, target, engine, target_path: str):
    from .heads.medusa import MedusaHeads

    heads, saved = MedusaHeads.load(heads_dir, target)
    c = heads.config
    lm_head = target.get_output_embeddings().weight
    tensors = {}
    for h in range(c.num_heads):
        for l in range(c.num_layers):
            linear = heads.blocks[h][l].linear
            names = (f"blocks.{h}.layers.{l}", f"{h}.{l}.linear")[engine == "medusa"]
            tensors[f"{names}.weight"], tensors[f"{names}.bias"] = linear.weight, linear.bias
        # Heads that share the target's LM head get a copy: both layouts want one per head.
        projection = lm_head.clone() if c.share_lm_head else heads.lm_heads[h].weight
        tensors[f"lm_heads.{h}.weight" if engine == "vllm" else f"{h}.{c.num_layers}.weight"] = projection
    if engine == "vllm":
        config = {"model_type": "medusa", "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                  "num_heads": c.num_heads, "num_hidden_layers": c.num_layers, "medusa_fc_bias": True}
        return tensors, config, "model.safetensors", (c.num_heads, c.num_layers)
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers,
              "base_model_name_or_path": target_path}
    return tensors, config, "medusa_lm_head.safetensors", (c.num_heads, c.num_layers)


def run(args: argparse.Namespace) -> int:
    out = export(args.kind, args.heads, args.target, args.engine, args.out, args.dtype)
    print(f"wrote {args.kind} heads for {args.engine} to {out}")
    return 0
