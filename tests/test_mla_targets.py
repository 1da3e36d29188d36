"""Targets with multi-head latent attention (DeepSeek V2 / V3, Kimi): their cache holds two latents
of different widths as keys and values (kv_lora_rank and qk_rope_head_dim), not heads of one
width. Squeezing holes out of the cache (CachedLM._maybe_compact) gathers each at its own width."""
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

import draftsman
from draftsman.verifier.cached_model import CachedLM

from tiny_models import load_for_reference

# A long and a short prompt: the short row's cache fills with holes up to the long one's slots.
PROMPTS = [list(range(5, 60)) + [5, 9, 13, 17], [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11]]
NEW = 60


def test_a_latent_attention_target_gives_its_own_greedy_output_through_compaction(tiny_tokenizer, tmp_path,
                                                                                monkeypatch):
    eos = tiny_tokenizer.eos_token_id
    config = DeepseekV3Config(vocab_size=len(tiny_tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                              hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.2,
                              kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, moe_intermediate_size=32)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    reference = load_for_reference(tmp_path)
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                   do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    compactions = []
    compact = CachedLM._maybe_compact

    def counting(self, slack=0.25):
        before = self.num_slots
        compact(self, slack)
        if self.num_slots < before:
            compactions.append(before - self.num_slots)

    monkeypatch.setattr(CachedLM, "_maybe_compact", counting)
    dec = draftsman.load({"target": {"path": str(tmp_path)}, "drafter": {"name": "ngram", "k": 3, "min_ngram": 1}})
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert out.token_ids == expected
    assert compactions, "no compaction ran: the test lost its point"
    first = dec.engine.target.cache.layers[0]  # the latents' widths differ: the case this file is about
    assert first.keys.shape[-1] != first.values.shape[-1], (first.keys.shape, first.values.shape)
