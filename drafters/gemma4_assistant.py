"""`gemma4_assistant`: a chain of up to `depth` tokens from a Gemma 4 assistant model (Google's
`gemma-4-*-assistant` checkpoints, Hugging Face's Gemma4AssistantForCausalLM) drafting for its
Gemma 4 target.

The assistant has no keys of its own: each of its layers attends, at the root's position, to the
target's keys and values of the committed tokens, read from the target's last full-attention and
last sliding layer that compute them (its "store" layers) in the verifier's own cache
(CachedLM.layer_slots; the target cache's rows are the drafter's). Its input is
[target embedding of the token; the state before it]: the target's top hidden state for the
root, then its own projected output for each drafted token. The position stays the root's, as in
Hugging Face's Gemma4AssistantCandidateGenerator. The sliding layers see the last `sliding_window`
committed positions and one more (as Hugging Face masks them), the full ones every committed
position.

Greedy: each token is the assistant's argmax (deterministic). Sampling: each token is drawn from
its distribution after the row's processing, returned as q: the verifier keeps output exact. Its
drafts follow the request's rules as the other model drafters' do (drafters/repeats.py): the
logit_bias and one-token bad words, the penalties, the EOS ban up to min_new_tokens, and the
bans that depend on the path (no_repeat_ngram_size, longer bad words, a grammar).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..models import check_dtype_name, resolve_dtype
from .base import Drafter, DraftTree, TargetNeeds
from .chain_draws import ChainRules, chain_trees
from .last_hidden import LastHiddenRows
from .registry import register


@register
class Gemma4AssistantDrafter(LastHiddenRows, Drafter):
    name = "gemma4_assistant"  # (its needs, with the cache margin it reads, are set in __init__)

    @dataclass
    class Options:
        path: str | None = None  # folder of the assistant model (e.g. gemma-4-E2B-it-assistant)
        depth: int = 4  # tokens drafted per round
        dtype: str | None = None  # the assistant's weights' dtype (default: the target's, which its keys are in)

        def __post_init__(self):
            if not self.path:
                raise ValueError("gemma4_assistant: set drafter.path to the assistant model's folder "
                                 "(a Gemma 4 *-assistant checkpoint made for the target)")
            if self.depth < 1:
                raise ValueError(f"gemma4_assistant: depth must be >= 1, got {self.depth}")
            if self.dtype is not None:
                check_dtype_name(self.dtype)

    def __init__(self, options, target):
        self.options = options
        self.device = target.device
        self.store_layers = _store_layers(target.model, target.path)
        folder = Path(options.path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"gemma4_assistant: '{folder}' holds no config.json; set drafter.path to the "
                                    "assistant model's folder")
        dtype = resolve_dtype(options.dtype, target.device) if options.dtype else target.dtype
        self.assistant = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(target.device).eval()
        _check_pair(self.assistant, target.model, folder, self.store_layers)
        self.embed = target.model.get_input_embeddings()
        text = self.assistant.config.get_text_config()
        self.window = getattr(text, "sliding_window", None)
        self.kinds = sorted(set(text.layer_types))
        self.vocab_size = text.vocab_size  # the target's (_check_pair)
        # Its sliding layers see positions from L - window - 1 on (L: the root's), Hugging Face's
        # mask; the target's trimmed cache keeps them from L - margin - its window + 1 on.
        target_window = getattr(target.model.config.get_text_config(), "sliding_window", None)
        margin = self.window + 2 - target_window if self.window and target_window else 0
        self.needs = TargetNeeds(hidden_state_layers=(-1,), target_cache=True, target_cache_margin=max(0, margin))
        self.target_lm = None  # the engine sets it (needs.target_cache)

    def max_depth(self) -> int:
        return self.options.depth

    def extra_parameters(self) -> int:
        return sum(p.numel() for p in self.assistant.parameters())

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.begin_rows(prompts, self.vocab_size)  # last_hidden: the state before each row's root

    @torch.no_grad()
    def propose(self, contexts):
        depth = self.options.depth if self.depth_limit is None else min(self.options.depth, self.depth_limit)
        ready = [h is not None for h in self.last_hidden]
        if depth == 0 or not any(ready):
            return [DraftTree.empty(self.device) for _ in contexts]
        if self.target_lm is None:
            raise RuntimeError("gemma4_assistant drafts inside the engine, which hands it the target's cache "
                               "(attach_target_cache); a wrapper holding it must pass that on")
        lengths = self.target_lm.lengths  # committed tokens per row: the root's position
        if len(lengths) != len(contexts):
            raise RuntimeError(f"gemma4_assistant: the target's cache holds {len(lengths)} rows, the round "
                               f"{len(contexts)}")
        kv, masks = self._target_keys(lengths)
        none = torch.zeros(self.assistant.config.backbone_hidden_size, device=self.device,
                           dtype=self.embed.weight.dtype)  # a one-token prompt's row drafts nothing
        state = torch.stack([h if h is not None else none for h in self.last_hidden])[:, None]  # (B, 1, d_target)
        root = torch.tensor([c[-1] for c in contexts], device=self.device)
        position = lengths[:, None]
        sampling = self.draft_sampling()

        def grow(token, _depth):  # the assistant on its own projected state and the token after it
            nonlocal state
            logits, state = self._step(token[:, None], state, position, kv, masks)
            return self.draft_context.biased(sampling, logits.float(), None)

        chain, probs = self._rules(contexts).draw_chain(grow(root, 0), depth, grow, sampling, self.generator)
        return chain_trees(chain, [depth] * len(contexts), sampling, lambda: torch.stack(probs, 1), ready)

    def _rules(self, contexts) -> ChainRules:
        """This round's penalties, EOS ban and path bans over the assistant's logits (every token)."""
        context, sampling, width = self.draft_context, self.draft_sampling(), self.vocab_size
        return ChainRules(context.round(sampling, contexts, width, None), context.eos_ban(self, contexts, width, None),
                          context.path_bans(sampling, contexts, None, self.grammar), len(contexts))

    def _step(self, token, state, position, kv, masks):
        """One assistant call: (B, 1) tokens and (B, 1, d_target) states -> logits (B, V) and the
        projected state (B, 1, d_target) the next token is fed with."""
        a = self.assistant
        inputs = torch.cat([self.embed(token).to(state.dtype), state], dim=-1).to(a.pre_projection.weight.dtype)
        out = a.model(inputs_embeds=a.pre_projection(inputs), attention_mask=masks, position_ids=position,
                      shared_kv_states=kv, use_cache=False)
        last = out.last_hidden_state
        if a.config.use_ordered_embeddings:
            logits = a.masked_embedding(last, a.lm_head.weight)
        else:
            logits = a.lm_head(last)
        return logits[:, 0], a.post_projection(last).to(state.dtype)

    def _target_keys(self, lengths):
        """The target's keys and values of each layer kind the assistant reads, and boolean masks
        (B, 1, 1, n) of the slots each row's query sees."""
        kv, masks = {}, {}
        for kind in self.kinds:
            keys, values, pos = self.target_lm.layer_slots(self.store_layers[kind])
            dtype = self.assistant.pre_projection.weight.dtype
            kv[kind] = keys.to(dtype), values.to(dtype)
            seen = pos >= 0
            if kind == "sliding_attention" and self.window is not None:  # the last window + 1 (Hugging Face's mask)
                seen &= pos >= lengths[:, None] - self.window - 1
            masks[kind] = seen[:, None, None, :]
        return kv, masks


def _store_layers(model, where: str) -> dict[str, int]:
    """The target's layer that keeps the keys of each kind the assistant reads: the last of that
    kind before its KV-sharing layers (Gemma 4's kv_sharing_modes "store")."""
    config = model.config.get_text_config()
    modes = getattr(config, "kv_sharing_modes", None)
    if not str(config.model_type).startswith("gemma4") or modes is None:
        raise ValueError(f"gemma4_assistant: the target in '{where}' is {config.model_type!r}, not Gemma 4; a "
                         "Gemma 4 assistant reads a Gemma 4 target's own keys. Draft with 'draft_model' or 'ngram'")
    return {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


def _check_pair(assistant, target, folder, store_layers: dict[str, int]) -> None:
    """An assistant made for another target reads keys of the wrong shape: refuse it by name."""
    if "Gemma4Assistant" not in type(assistant).__name__:
        raise ValueError(f"gemma4_assistant: '{folder}' holds a {type(assistant).__name__}, not a Gemma 4 assistant "
                         "(Gemma4AssistantForCausalLM); for a small causal LM use drafter 'draft_model'")
    a, t = assistant.config, target.config.get_text_config()
    text = a.get_text_config()
    problems = []
    if a.backbone_hidden_size != t.hidden_size:
        problems.append(f"it reads states {a.backbone_hidden_size} wide, the target's are {t.hidden_size}")
    if text.vocab_size != t.vocab_size:
        problems.append(f"its vocabulary has {text.vocab_size} tokens, the target's {t.vocab_size}")
    for kind, index in store_layers.items():  # its queries meet the target's keys of that kind
        theirs = target.model.layers[index].self_attn.head_dim
        mine = next((layer.self_attn.head_dim for layer, k in zip(assistant.model.layers, text.layer_types)
                     if k == kind), theirs)
        if mine != theirs:
            problems.append(f"its {kind} heads are {mine} wide, the target's keys {theirs}")
    if problems:
        raise ValueError(f"gemma4_assistant: the assistant in '{folder}' was made for another target: "
                         f"{'; '.join(problems)}. Use the assistant released with this target")
