"""top-p (and typical-p) over a 152k vocabulary (Qwen2's 151936): ranking only the likeliest (the
nearest) candidates (verifier/sampling.py, _top_p, _typical) against sorting the whole vocabulary
for every position, as Hugging Face's TopPLogitsWarper and TypicalLogitsWarper do and draftsman
did before.

1. The warp alone: milliseconds per call for 1, 6 and 21 positions (a token, a chain of 5 drafts,
   a 20-node tree), for peaked rows (the likeliest 1024 tokens hold top_p of the mass, as for a
   trained model at T <= 1) and flat ones (they do not: those rows still sort everything).
2. Generation: a Qwen2 of 2 layers with that vocabulary, its LM head scaled so its distributions
   are peaked, at T=0.7 top_p=0.9 with `none` and `ngram`; the two ways interleaved in one
   process, with the same seeds, so their outputs must be equal.
3. The draw itself (verifier/sampling.py, sample_from): the inverse-CDF draw with the earlier
   second pass over the vocabulary (a cumulative count of the tokens with mass, for the rare u that
   rounds up to the total) against a second binary search; alone, and in generation at T=1.

    python scripts/top_p_large_vocab_experiment.py          # all three
    python scripts/top_p_large_vocab_experiment.py draws    # the third only
"""
import statistics
import sys
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import draftsman
from draftsman.verifier import rejection, sampling
from draftsman.verifier.sampling import SamplingParams, processed_probs

VOCAB = 151936


def sort_everything(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The earlier top-p: Hugging Face's, one sort of the whole vocabulary per position."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    drop_sorted = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)
    drop_sorted[..., -1] = False
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def sort_everything_typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """The earlier typical-p: Hugging Face's, one sort of the whole vocabulary by distance."""
    log_probs = scores.log_softmax(-1)
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    sorted_distance, order = torch.sort(distance, descending=False)
    cumulative = scores.gather(-1, order).softmax(-1).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp(max=scores.shape[-1] - 1)
    drop_sorted = sorted_distance > sorted_distance.gather(-1, last)
    return scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


WAYS = {"sort the whole vocabulary": sort_everything, "rank the candidates": sampling._top_p}
TYPICAL_WAYS = {"sort the whole vocabulary": sort_everything_typical, "rank the candidates": sampling._typical}


def warp_ms(logits: torch.Tensor, params: SamplingParams, name: str = "_top_p", repeats: int = 5) -> dict:
    """ms per processed_probs call with each way of the warper `name`, and how many tokens the two
    keep differently (float32 sums over 152k tokens round differently: a flat row may differ by one)."""
    out, kept = {}, []
    for way, warper in (WAYS if name == "_top_p" else TYPICAL_WAYS).items():
        setattr(sampling, name, warper)
        kept.append(processed_probs(logits, params) > 0)
        start = time.perf_counter()
        for _ in range(repeats):
            processed_probs(logits, params)
        out[way] = (time.perf_counter() - start) / repeats * 1000
    setattr(sampling, name, warper)  # the last way is the library's own
    return out, int((kept[0] ^ kept[1]).sum())


def sample_from_two_passes(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The earlier draw: the last token with mass found by a cumulative count over the vocabulary."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, uniforms.to(cdf.dtype).unsqueeze(-1) * total, right=True).squeeze(-1)
    return torch.minimum(idx, (probs > 0).to(torch.long).cumsum(-1).argmax(-1))


DRAWS = {"two passes": sample_from_two_passes, "a second search": sampling.sample_from}


def use_draw(draw) -> None:
    sampling.sample_from = rejection.sample_from = draw  # rejection imported it by name


def target_folder(layers: int = 2) -> str:
    """A Qwen2 with Qwen2's vocabulary, its LM head scaled so its distributions are peaked."""
    folder = tempfile.mkdtemp()
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # peaked distributions, as a trained model's
    model.save_pretrained(folder)
    return folder


def draws_section() -> None:
    torch.manual_seed(0)
    print(f"3. sample_from over {VOCAB} tokens, ms per call")
    print("| rows | two passes | a second search | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for rows in (1, 6, 21):
        probs = torch.softmax(torch.randn(rows, VOCAB) * 6.0, -1)
        uniforms = torch.rand(rows, dtype=torch.float64)
        ms = {}
        for way, draw in DRAWS.items():
            draw(probs, uniforms)
            start = time.perf_counter()
            for _ in range(20):
                draw(probs, uniforms)
            ms[way] = (time.perf_counter() - start) / 20 * 1000
        same = torch.equal(*(draw(probs, uniforms) for draw in DRAWS.values()))
        before, after = ms.values()
        print(f"| {rows} | {before:.2f} | {after:.2f} | {before / after:.1f}x | {same} |")
    folder = target_folder()
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (24,))] for _ in range(3)]
    print("\nGeneration: the Qwen2 of section 2; 3 prompts of 24 tokens, 64 new, T=1, batch 1 and 4, "
          "seeds 0-2, 3 repeats interleaved")
    print("| drafter | batch | two passes tok/s | a second search tok/s | ratio | tau |")
    print("|---|---|---|---|---|---|")
    for drafter in ({"name": "none"}, {"name": "ngram"}):
        dec = draftsman.load({"target": {"path": folder}, "drafter": drafter})
        for batch in (1, 4):
            speed, outputs, tau = {w: [] for w in DRAWS}, {w: [] for w in DRAWS}, []
            for _ in range(3):
                for way, draw in DRAWS.items():
                    use_draw(draw)
                    for seed, prompt in enumerate(prompts):
                        start = time.perf_counter()
                        out = dec.generate(input_ids=[prompt] * batch, max_new_tokens=64, temperature=1.0, seed=seed)
                        speed[way].append(sum(map(len, out.token_ids)) / (time.perf_counter() - start))
                        outputs[way].append(out.token_ids)
                        tau.append(out.stats.tau)
            use_draw(DRAWS["a second search"])
            same = outputs["two passes"] == outputs["a second search"]
            before, after = (statistics.median(speed[w]) for w in DRAWS)
            print(f"| {drafter['name']} | {batch} | {before:.1f} | {after:.1f} | {after / before:.2f}x | "
                  f"{statistics.mean(tau):.2f} |" + ("" if same else " (outputs differ)"))


def main() -> None:
    if sys.argv[1:] == ["draws"]:
        return draws_section()
    torch.manual_seed(0)
    params = SamplingParams(0.7, top_p=0.9)
    print(f"1. processed_probs at T=0.7 top_p=0.9 over {VOCAB} tokens, ms per call (torch threads: "
          f"{torch.get_num_threads()})")
    print("| positions | rows | sort the whole vocabulary | rank the candidates | ratio | tokens kept differently |")
    print("|---|---|---|---|---|---|")
    for n in (1, 6, 21):
        for kind, scale in (("peaked", 6.0), ("flat", 0.5)):
            ms, differ = warp_ms(torch.randn(n, VOCAB) * scale, params)
            before, after = ms.values()
            print(f"| {n} | {kind} | {before:.1f} | {after:.1f} | {before / after:.1f}x | {differ} |")
    print("\nThe same for typical_p=0.9 at T=0.7 (the nearest 1024 tokens to the entropy):")
    print("| positions | rows | sort the whole vocabulary | rank the candidates | ratio | tokens kept differently |")
    print("|---|---|---|---|---|---|")
    for n in (1, 6, 21):
        for kind, scale in (("peaked", 6.0), ("flat", 0.5)):
            ms, differ = warp_ms(torch.randn(n, VOCAB) * scale, SamplingParams(0.7, typical_p=0.9), "_typical")
            before, after = ms.values()
            print(f"| {n} | {kind} | {before:.1f} | {after:.1f} | {before / after:.1f}x | {differ} |")

    folder = target_folder()
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (24,))] for _ in range(3)]
    print(f"\n2. Generation: Qwen2, 2 layers, hidden 64, {VOCAB} tokens; 3 prompts of 24 tokens, 64 new, "
          "T=0.7 top_p=0.9, batch 1, seeds 0-2, 2 repeats interleaved")
    print("| drafter | sort the whole vocabulary tok/s | rank the candidates tok/s | ratio | tau |")
    print("|---|---|---|---|---|")
    for drafter in ({"name": "none"}, {"name": "ngram"}):
        dec = draftsman.load({"target": {"path": folder}, "drafter": drafter})
        speed, outputs, tau = {w: [] for w in WAYS}, {w: [] for w in WAYS}, []
        for _ in range(2):
            for way, top_p in WAYS.items():
                sampling._top_p = top_p
                for seed, prompt in enumerate(prompts):
                    start = time.perf_counter()
                    out = dec.generate(input_ids=[prompt], max_new_tokens=64, temperature=0.7, top_p=0.9, seed=seed)
                    speed[way].append(len(out.token_ids[0]) / (time.perf_counter() - start))
                    outputs[way].append(out.token_ids[0])
                    tau.append(out.stats.tau)
        sampling._top_p = WAYS["rank the candidates"]
        same = outputs["sort the whole vocabulary"] == outputs["rank the candidates"]
        before, after = (statistics.median(speed[w]) for w in WAYS)
        print(f"| {drafter['name']} | {before:.1f} | {after:.1f} | {after / before:.2f}x | "
              f"{statistics.mean(tau):.2f} |" + ("" if same else " (outputs differ)"))


if __name__ == "__main__":
    main()
