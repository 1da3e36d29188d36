"""The peers: Hugging Face transformers' own `generate` on the same loaded target weights, greedy.

    hf_generate          model.generate(...)                                  plain decoding
    hf_assisted          model.generate(..., assistant_model=<draft model>)    their draft-model speculation
    hf_prompt_lookup     model.generate(..., prompt_lookup_num_tokens=k)       their n-gram lookup
    hf_universal_assisted  model.generate(..., assistant_model=<draft model>, tokenizer=...,
                         assistant_tokenizer=...)                             theirs with another tokenizer
    hf_early_exit        model.generate(..., assistant_early_exit=n)          their self-speculation (LayerSkip)

Each runs with transformers' own defaults for everything not set here (assisted: up to
`num_assistant_tokens` drafts per round, cut short when the assistant's confidence falls below
`assistant_confidence_threshold`), which is what a user of `generate` gets.
"""
from __future__ import annotations

import time

import torch
from transformers.utils import logging as hf_logging

from ..models import load_causal_lm, load_tokenizer
from .runner import PeerFailed, Run


class HFPeer:
    kind = "peer"

    def __init__(self, label: str, model, extra: dict, extra_parameters: int = 0, pad_token_id: int | None = None,
                 min_new_tokens: int = 0):
        self.label = label
        self.min_new_tokens = min_new_tokens
        self.model = model
        self.extra = extra  # generate kwargs that make this peer what it is
        self.extra_parameters = extra_parameters
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device

    @property
    def settings(self) -> dict:
        """The generate kwargs, printable (the assistant model shown by its path)."""
        shown_by_path = ("assistant_model", "tokenizer", "assistant_tokenizer")
        return {k: (getattr(v, "name_or_path", type(v).__name__) if k in shown_by_path else v)
                for k, v in self.extra.items()}

    @torch.no_grad()
    def run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Run:
        if temperature != 0:
            raise ValueError("the Hugging Face peers run greedy only (temperature 0)")
        if len(prompts) != 1:
            raise ValueError("the Hugging Face peers run one prompt at a time (assisted generation needs batch 1)")
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        # Assisted generation logs a deprecation about its own internal call on every run.
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            t0 = time.perf_counter()
            try:
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=max_new_tokens, pad_token_id=self.pad_token_id,
                                          min_new_tokens=min(self.min_new_tokens, max_new_tokens), **self.extra)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                raise PeerFailed(self, e) from e
            new = out[0, ids.shape[1]:].tolist()  # .tolist() waits for the device: the time is complete
            seconds = time.perf_counter() - t0
        finally:
            hf_logging.set_verbosity(level)
        return Run([new], seconds, None)


def build_peers(decoder, drafters: list[dict], min_new_tokens: int = 0) -> tuple[list[HFPeer], list[str]]:
    """The peers for this target, and notes on any that cannot run. The assistant is the first
    `draft_model` drafter's model; the lookup length is the first `ngram` drafter's k (its
    default if unset or if there is none); a `cross_tokenizer` drafter lends its model and
    tokenizer to universal assisted generation; a `layer_skip` drafter's exit_layer is their early
    exit's. Every peer runs with `min_new_tokens`, as ours do."""
    from ..drafters.ngram import NgramDrafter

    model = decoder.target
    gen = getattr(model, "generation_config", None)
    pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        eos = sorted(decoder.engine.eos_token_ids)
        pad = eos[0] if eos else 0
    peers = [HFPeer("hf_generate", model, {}, pad_token_id=pad, min_new_tokens=min_new_tokens)]
    notes = []
    draft = next((d for d in drafters if d["name"] == "draft_model"), None)
    if draft is not None:
        dtype = draft.get("dtype") or str(model.dtype).replace("torch.", "")
        assistant = load_causal_lm(draft["path"], dtype, decoder.device, what="assistant model")
        params = sum(p.numel() for p in assistant.parameters())
        peers.append(HFPeer("hf_assisted", model, {"assistant_model": assistant}, params, pad, min_new_tokens))
    else:
        notes.append("hf_assisted skipped: no draft_model drafter in the config to lend its model")
    cross = next((d for d in drafters if d["name"] == "cross_tokenizer"), None)
    if cross is not None and decoder.tokenizer is not None:
        dtype = cross.get("dtype") or str(model.dtype).replace("torch.", "")
        assistant = load_causal_lm(cross["path"], dtype, decoder.device, what="assistant model")
        extra = {"assistant_model": assistant, "tokenizer": decoder.tokenizer,
                 "assistant_tokenizer": load_tokenizer(cross["path"])}
        peers.append(HFPeer("hf_universal_assisted", model, extra, sum(p.numel() for p in assistant.parameters()),
                            pad, min_new_tokens))
    early = next((d for d in drafters if d["name"] == "layer_skip" and d.get("exit_layer") is not None), None)
    if early is not None:  # the target drafts with its own first exit_layer layers, as our layer_skip does
        peers.append(HFPeer("hf_early_exit", model, {"assistant_early_exit": int(early["exit_layer"])},
                            pad_token_id=pad, min_new_tokens=min_new_tokens))
    default_k = NgramDrafter.Options.k
    k = next((int(d.get("k", default_k)) for d in drafters if d["name"] == "ngram"), default_k)
    peers.append(HFPeer("hf_prompt_lookup", model, {"prompt_lookup_num_tokens": k}, pad_token_id=pad,
                        min_new_tokens=min_new_tokens))
    return peers, notes
