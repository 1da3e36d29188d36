"""`layer_skip`: self-speculative decoding. The target drafts for itself with part of its own
decoder layers, then its final norm and LM head: the first `exit_layer` layers (early exit, as
LayerSkip models are trained for and as transformers' `assistant_early_exit` runs them), or all but
`skip_layers` (Draft & Verify, SWIFT). No second model and no extra weights: the drafting model is
a view that shares the target's modules, so it needs no training, no tokenizer check and no memory
beyond its own KV cache (and, under `draft_vocab`, its copy of those LM head rows).

It drafts as `draft_model` does (drafters/draft_model.py: a chain of k, or with `top_k > 1` a
dynamic tree at T=0; `min_confidence`, `draft_vocab`, penalties), from that view. Each draft's q is
what the view computes, so the shared verifier keeps the target's distribution whatever layers are
skipped: skipping more costs acceptance, never correctness. A target not trained for early exit
reads its middle layers poorly through its last norm, and a drafted token costs most of a target
pass: on the bundled 6-layer target the first 4 layers drafted with first-token acceptance 0.68,
all but layer 4 with 0.83 (tau 3.18), and both ran slower than plain decoding (0.60x, 0.72x at
T=0; docs/benchmarks.md). It is for deep targets, where skipping a third of the layers keeps most
of the agreement, and for checkpoints trained with an early-exit loss (LayerSkip).

The view's causal LM keeps the target's config, so its KV cache has a slot list for every layer and
each kept layer writes to its own index (a skipped layer's stays empty): the layers carry their
index in the model they came from. Its base model reads a config of the kept layers only (their
per-layer lists in their order: each layer's mask kind). Hugging Face sizes the masks it builds from
the cache's first (or first sliding) layer, which the view may skip and never write: its cache always
passes draftsman's own mask (CachedLM's own_masks).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from torch import nn

from ..verifier.cached_model import has_recurrent_layers
from .draft_model import DraftModelDrafter, check_chain_options
from .registry import register


def decoder_layers_path(model: nn.Module) -> list[str]:
    """The attribute path to the ModuleList of the model's decoder layers: Llama's `model.layers`,
    GPT-2's `transformer.h` (the shortest list as long as the config's layer count)."""
    count = model.config.get_text_config().num_hidden_layers
    paths = [path for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    depth = min((path.count(".") for path in paths), default=None)
    shortest = [path for path in paths if path.count(".") == depth]
    if len(shortest) != 1:
        raise ValueError(f"layer_skip: cannot tell which list of '{model.config.model_type}' holds its {count} decoder "
                         f"layers (candidates: {shortest or 'none'}): this model family is not supported")
    return shortest[0].split(".")


def shallow_view(module: nn.Module) -> nn.Module:
    """A copy of `module` that shares its parameters, buffers and children, and whose children can be
    replaced without touching the original."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    return view


def kept_layers_config(config, keep: list[int]):
    """The config as a model of only the layers `keep` reads it: Gemma's, Qwen2's and Llama 4's
    forwards pick the i-th layer's mask by config.layer_types[i], so every per-layer list is read
    in the kept layers' order. (The causal LM's config, which sizes the KV cache, stays the
    target's: each kept layer writes at its own index.)"""
    count = config.num_hidden_layers
    view = copy.copy(config)
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == count:
            setattr(view, key, [value[i] for i in keep])
    view.num_hidden_layers = len(keep)
    return view


def layer_view(model: nn.Module, keep: list[int]) -> nn.Module:
    """The causal LM `model` running only the decoder layers `keep` (in order): embeddings, final
    norm and LM head are the model's own objects, so are the kept layers."""
    *holders, name = decoder_layers_path(model)
    originals = [model]
    for attribute in holders:
        originals.append(getattr(originals[-1], attribute))
    views = [shallow_view(m) for m in originals]
    layers = getattr(originals[-1], name)
    setattr(views[-1], name, nn.ModuleList([layers[i] for i in keep]))
    for parent, attribute, child in zip(views, holders, views[1:]):
        setattr(parent, attribute, child)
    views[-1].config = kept_layers_config(originals[-1].config, keep)  # the base model, which runs the layers
    return views[0]


def kept_layers(exit_layer: int | None, skip_layers: list[int] | None, count: int) -> list[int]:
    """The layers the view runs, checked against the target's `count`."""
    if exit_layer is not None:
        if not 1 <= exit_layer < count:
            raise ValueError(f"layer_skip: exit_layer={exit_layer} must be in 1..{count - 1} (the target has {count} "
                             f"decoder layers; the drafts run the first exit_layer of them)")
        return list(range(exit_layer))
    outside = sorted(i for i in skip_layers if not 0 <= i < count)
    if outside:
        raise ValueError(f"layer_skip: skip_layers {outside} are not layers of the target, whose decoder layers are "
                         f"0..{count - 1}")
    skipped = set(skip_layers)
    keep = [i for i in range(count) if i not in skipped]
    if not keep:
        raise ValueError(f"layer_skip: skip_layers skips all {count} decoder layers: keep one at least")
    return keep


@register
class LayerSkipDrafter(DraftModelDrafter):
    name = "layer_skip"
    # Its cache's skipped layers stay empty, and Hugging Face sizes the masks it builds from the first ones.
    runs_part_of_its_layers = True

    @dataclass
    class Options:
        exit_layer: int | None = None  # draft with the target's first N decoder layers (early exit, LayerSkip)
        skip_layers: list[int] | None = None  # or: draft with all the target's layers but these (Draft & Verify)
        k: int = 4  # tokens drafted per round
        min_confidence: float | None = None  # a chain stops after a token drawn with prob < this (as draft_model)
        top_k: int = 1  # greedy rounds: > 1 drafts a dynamic tree of depth k instead of a chain
        total_tokens: int = 10  # nodes kept in that tree
        draft_vocab: int | None = None  # draft among the N tokens the target picks most (None = all)
        vocab_order: str | None = None  # where draft_vocab's order is: a JSON file or folder (None = the target's)
        draft_vocab_sampling: bool = False  # sampled rounds draft among those N tokens too (costs acceptance)
        penalise_drafts: bool = False  # under penalties, penalise the drafts too (drafters/repeats.py)
        # draft_model's options that a view of the target fixes (class attributes, not config keys):
        # the target's own weights and dtype, one token per pass.
        path = None
        dtype = None
        quantize = None
        parallel_drafting = False
        mask_token_id = None

        def __post_init__(self):
            if (self.exit_layer is None) == (self.skip_layers is None):
                raise ValueError("layer_skip: set exactly one of exit_layer (draft with the target's first N layers) "
                                 "and skip_layers (draft with all its layers but these)")
            # The bounds that need no model (the layer count is checked once the target loads: kept_layers).
            if self.exit_layer is not None and self.exit_layer < 1:
                raise ValueError(f"layer_skip: exit_layer={self.exit_layer} must be >= 1: the drafts run the "
                                 "target's first exit_layer decoder layers")
            if self.skip_layers == []:  # the drafts would run the whole target: as slow as it, for tau about k + 1
                raise ValueError("layer_skip: skip_layers is empty, so the drafts would run every layer of the "
                                 "target: skip at least one layer, or set exit_layer instead")
            negative = sorted({i for i in self.skip_layers or [] if i < 0})
            if negative:
                raise ValueError(f"layer_skip: skip_layers {negative} are not layers: decoder layers count from 0 "
                                 "(a negative index does not count from the end)")
            check_chain_options("layer_skip", self)

    def __init__(self, options: "LayerSkipDrafter.Options", target):
        if options.draft_vocab is not None and options.vocab_order is None:
            # draft_vocab's order: the target's own picks, counted in its folder by `draftsman vocab`.
            options = dataclasses.replace(options, vocab_order=target.path)
        super().__init__(options, target)

    def _own_parameters(self, model):
        return 0  # the view's weights are the target's; draft_vocab's copy of LM head rows is counted apart

    def _load_model(self, options, target, quantize):
        if has_recurrent_layers(target.model.config):
            raise ValueError(f"layer_skip: '{target.path}' has recurrent layers, whose states a view of part of its "
                             "layers cannot keep apart from the target's: draft with another drafter")
        config = target.model.config.get_text_config()
        if getattr(config, "hidden_size_per_layer_input", None) or getattr(config, "num_kv_shared_layers", None):
            raise ValueError(f"layer_skip: '{target.path}' ({config.model_type}) gives each layer an input embedding "
                             "of its own and has layers that read earlier layers' keys, which a view of part of its "
                             "layers cannot keep: draft with another drafter (for Gemma 4, its assistant: "
                             "gemma4_assistant)")
        count = config.num_hidden_layers
        return layer_view(target.model, kept_layers(options.exit_layer, options.skip_layers, count))
