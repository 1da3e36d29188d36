"""A target's own multi-token-prediction layers, as its checkpoint ships them (DeepSeek-V3, GLM-4.5,
Qwen3-Next, Qwen3.5, Ernie 4.5 MoE, Mellum, ...), read into a FeatureHead of kind mtp so they draft
like a trained one.

Hugging Face loads them (transformers.modeling_layers.MtpModel: the checkpoint's MTP keys and each
model's renamings); this file only moves the first MTP layer's modules into the head:

    MtpLayer.enorm / hnorm   -> FeatureHead.norm_embed / norm_hidden
    MtpLayer.eh_proj         -> FeatureHead.fuse   (input [embedding; hidden], as the head's)
    MtpLayer.mtp_block       -> the head's decoder layer
    MtpLayer.post_norm       -> the head's final norm (the model's shared_head.norm), before the
                                target's own LM head

A model with several MTP layers trained layer k for depth k + 1; the head chains the first one
beyond depth 1, as it does for a trained `mtp` head. Drafts only: the verifier keeps output exact.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import re

import torch
from torch import nn

from .feature_head import FeatureHead, FeatureHeadConfig, decoder_layers, final_norm_owner


def num_mtp_layers(target: nn.Module) -> int:
    """How many MTP layers the target's config says its checkpoint holds: num_mtp_layers (the key
    Hugging Face reads, num_nextn_predict_layers in DeepSeek's config.json) or Qwen3-Next's and
    Qwen3.5's mtp_num_hidden_layers, which transformers keeps but does not load from."""
    text = target.config.get_text_config()
    keys = ("num_mtp_layers", "mtp_num_hidden_layers", "num_nextn_predict_layers")
    return int(next((getattr(text, key) for key in keys if getattr(text, key, None)), 0))


@contextlib.contextmanager
def _qwen_mtp_named(text):
    """Qwen3-Next and Qwen3.5 name their MTP layers mtp_num_hidden_layers, and their checkpoints keep
    them in the `mtp.` layout Hugging Face's MtpModel reads (Mellum's): while it loads, the config
    names them as MtpModel asks (num_mtp_layers; the MTP layers attend, as vLLM's Qwen3-Next MTP)."""
    if getattr(text, "num_mtp_layers", None) or not getattr(text, "mtp_num_hidden_layers", None):
        yield
        return
    n = int(text.mtp_num_hidden_layers)
    added = ["num_mtp_layers"] + (["mtp_layer_types"] if getattr(text, "layer_types", None) is not None else [])
    text.num_mtp_layers = n
    if "mtp_layer_types" in added:
        text.mtp_layer_types = ["full_attention"] * n
    try:
        yield
    finally:
        for key in added:
            delattr(text, key)


# Patterns of checkpoint keys a text-only target skips that are not MTP layers: an image-text
# checkpoint's vision (or audio) tower.
_NOT_MTP = re.compile(r"visual|vision|audio")


@contextlib.contextmanager
def _mtp_keys_only(target):
    """MtpModel reads every checkpoint key the target's class skips (_keys_to_ignore_on_load_unexpected),
    and Qwen3.5's text class skips an image-text checkpoint's vision tower too: each of its tensors
    would be listed as UNEXPECTED in transformers' load report (hundreds of lines). While it loads,
    the target skips its MTP keys only; the MTP keys themselves are untouched, so missing ones still fail."""
    patterns = getattr(target, "_keys_to_ignore_on_load_unexpected", None) or []
    kept = [p for p in patterns if not _NOT_MTP.search(p)]
    if len(kept) == len(patterns):
        yield
        return
    own = vars(target).get("_keys_to_ignore_on_load_unexpected")  # usually the class's, not the instance's
    target._keys_to_ignore_on_load_unexpected = kept  # on the instance: the class keeps its own
    try:
        yield
    finally:
        if own is None:
            del target._keys_to_ignore_on_load_unexpected
        else:
            target._keys_to_ignore_on_load_unexpected = own


_SHOWN_KEYS = 5


def _capped(error: Exception) -> str:
    """transformers' message with its list of missing keys cut to the first few (a 256-expert MTP
    layer lists hundreds)."""
    text = str(error)
    head, sep, listed = text.rpartition(": [")
    try:
        keys = ast.literal_eval("[" + listed) if sep else None
    except (ValueError, SyntaxError):
        keys = None
    if not isinstance(keys, list):
        return text
    more = f" ... {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return f"{head}: {', '.join(map(str, keys[:_SHOWN_KEYS]))}{more}"


def load_native_mtp(target: nn.Module, drafter: str = "native_mtp") -> FeatureHead:
    """The target's first MTP layer as an mtp FeatureHead, in the target's dtype and on its device."""
    from transformers.modeling_layers import MtpModel

    where = getattr(target.config, "name_or_path", "") or "the target folder"
    if num_mtp_layers(target) == 0:
        raise ValueError(
            f"{drafter}: the target {type(target).__name__} in '{where}' has no MTP layers in its config "
            "(num_mtp_layers / num_nextn_predict_layers / mtp_num_hidden_layers is unset or 0), so its checkpoint "
            "ships none to load (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5 and Mellum configs name theirs). Train an "
            "MTP module for it instead (`draftsman train mtp`, then drafter: mtp), or draft with 'eagle' or "
            "'draft_model'")
    text = target.config.get_text_config()
    if not getattr(text, "num_mtp_layers", None) and not getattr(text, "mtp_num_hidden_layers", None):
        import transformers  # a config that names MTP layers under a key Hugging Face does not load them by

        raise NotImplementedError(
            f"{drafter}: the config of '{where}' names {num_mtp_layers(target)} MTP layer(s), but transformers "
            f"{transformers.__version__} loads no MTP layers for {text.model_type} models; draft with 'eagle' or "
            "'draft_model', or train an MTP module for it (`draftsman train mtp`, then drafter: mtp)")
    if getattr(text, "mtp_use_dedicated_embeddings", False):
        raise NotImplementedError(f"{drafter}: the MTP layers of '{where}' have embeddings of their own "
                                  "(mtp_use_dedicated_embeddings), which Hugging Face's MtpModel does not load; "
                                  "draft with 'eagle' or 'draft_model'")
    try:
        with _qwen_mtp_named(text), _mtp_keys_only(target):
            loaded = MtpModel.from_pretrained(target)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"{drafter}: cannot load the MTP layers of '{where}': the config names "
                         f"{num_mtp_layers(target)} MTP layer(s); the checkpoint must hold their weights (a "
                         f"checkpoint saved by Hugging Face's save_pretrained drops them). {_capped(e)}") from e
    if getattr(loaded.config, "logits_mup_width_multiplier", None) is not None:
        raise NotImplementedError(f"{drafter}: {type(target).__name__} scales its logits (muP) before the LM "
                                  "head, which the head here does not; draft with 'eagle' or 'draft_model'")
    mtp = loaded.layers[0]
    d = target.get_output_embeddings().weight.shape[1]
    head = FeatureHead(FeatureHeadConfig("mtp", d, target.get_output_embeddings().weight.shape[0]), target,
                       body_config=_first_layer_config(loaded.config))
    head.norm_embed, head.norm_hidden = mtp.enorm, mtp.hnorm
    head.fuse = mtp.eh_proj
    if getattr(loaded.config, "mtp_hidden_states_first", False):  # the input is [hidden; embedding]
        with torch.no_grad():
            head.fuse.weight.copy_(torch.cat([mtp.eh_proj.weight[:, d:], mtp.eh_proj.weight[:, :d]], dim=1))
    decoder_layers(head.body)[0] = mtp.mtp_block
    post_norm = mtp.post_norm if mtp.post_norm is not None else getattr(loaded, "shared_post_norm", nn.Identity())
    owner, norm_name = final_norm_owner(head.body)
    setattr(owner, norm_name, post_norm)
    head.parts[norm_name] = post_norm  # the head's own: .to() and casts reach it, the target's norm stays
    empty = [name for name, p in head.named_parameters() if p.is_meta]
    if empty:  # a part of the body that is neither the MTP layer's nor the target's
        raise NotImplementedError(f"{drafter}: {type(target).__name__}'s MTP layer leaves {empty} without weights; "
                                  "draft with 'eagle' or 'draft_model'")
    device = target.get_output_embeddings().weight.device
    return head.to(device).eval()  # in the checkpoint's dtype: a float32 copy of a large MoE layer would not fit


def _first_layer_config(mtp_config):
    """The MTP config (the target's, with the MTP layers' kinds: Mellum's slides, with that kind's
    RoPE) cut to its first layer: the head's body."""
    config = copy.deepcopy(mtp_config)
    config.num_hidden_layers = 1
    for key in ("layer_types", "mlp_layer_types"):
        if getattr(config, key, None) is not None:
            setattr(config, key, list(getattr(config, key))[:1])
    return config
