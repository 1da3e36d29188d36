"""What a drafter's `memory_file` is worth after a restart, and what it costs (docs/choosing-a-drafter.md).

One process plays two: "before" runs --warm-prompts held-out prompts through `recycling` and
`suffix` drafters that have a memory_file and saves them (Decoder.save_drafter_memory); "after
the restart" loads fresh drafters from those files and times them, interleaved prompt by prompt
with the same drafters started empty and with plain decoding (T=0, batch 1, outputs checked
equal to plain decoding's), on

  new        --prompts other held-out prompts (what the memory teaches about the target's text)
  repeated   the warm prompts again (requests sent again after the restart)

Both kinds of drafter go on learning from prompt to prompt, so an empty one catches up: the
figures for the first few prompts alone show what the memory is worth right after a restart.

Then the cost at a large scale: a full candidate matrix of a 151,936-token vocabulary (Qwen2's)
and a suffix cache of 1000 rows of 224 tokens, each saved and loaded.

    python scripts/drafter_memory_experiment.py --prompts 16 --warm-prompts 16 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import draftsman
from draftsman.drafters.recycling import RecyclingDrafter
from draftsman.drafters.suffix import SuffixDrafter
from draftsman.prompts import heldout_prompts

DRAFTERS = {"recycling": {"name": "recycling"}, "suffix": {"name": "suffix"}}
FIRST = 4


def timed(decoder, prompt: list[int], max_new_tokens: int):
    t0 = time.perf_counter()
    out = decoder.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=0.0)
    return time.perf_counter() - t0, out


def restart(base, folder: Path, warm: list[list[int]], ids: list[list[int]], max_new_tokens: int) -> None:
    for label, config in DRAFTERS.items():
        before = base.with_drafter({**config, "memory_file": str(folder / f"{label}.safetensors")})
        for prompt in warm:
            before.generate(input_ids=[prompt], max_new_tokens=max_new_tokens, temperature=0.0)
        t0 = time.perf_counter()
        [path] = before.save_drafter_memory()
        print(f"{label}: saved {Path(path).stat().st_size / 1e6:.2f} MB in {1e3 * (time.perf_counter() - t0):.1f} ms")

    for case, prompts in (("new", ids), ("repeated", warm)):
        decoders = {"none": base}
        for label, config in DRAFTERS.items():
            t0 = time.perf_counter()
            memory = {**config, "memory_file": str(folder / f"{label}.safetensors")}
            decoders[f"{label}, memory"] = base.with_drafter(memory)
            print(f"{case}: {label} loaded its memory in {1e3 * (time.perf_counter() - t0):.0f} ms (with the drafter)")
            decoders[f"{label}, empty"] = base.with_drafter(config)
        seconds, taus, outputs = {k: [] for k in decoders}, {k: [] for k in decoders}, {k: [] for k in decoders}
        for prompt in prompts:
            for label, decoder in decoders.items():
                spent, out = timed(decoder, prompt, max_new_tokens)
                seconds[label].append(spent)
                taus[label].append(out.stats.tau)
                outputs[label].append(out.token_ids)
        assert all(outputs[k] == outputs["none"] for k in decoders), "outputs differ from plain decoding"
        first = min(FIRST, len(prompts))  # where an empty drafter has learnt least
        print(f"after the restart, {case} prompts ({len(prompts)}), {max_new_tokens} new tokens, T=0: speed over "
              f"plain decoding (same pass, interleaved), tau; the first {first} prompts alone")
        for label in decoders:
            if label != "none":
                cells = [f"{sum(seconds['none'][:n]) / sum(seconds[label][:n]):5.2f}x "
                         f"(tau {sum(taus[label][:n]) / n:5.2f})" for n in (len(prompts), first)]
                print(f"  {label:20s} {cells[0]}   first {first}: {cells[1]}")


def save_then_load(drafter, build) -> tuple[float, float]:
    """Seconds to save the drafter's memory, and to build the same drafter again from it."""
    t0 = time.perf_counter()
    drafter.save_memory()
    t1 = time.perf_counter()
    build()
    return t1 - t0, time.perf_counter() - t1


def cost_at_scale(folder: Path) -> None:
    vocab, model = 151_936, torch.nn.Linear(64, 151_936, bias=False)
    model.get_output_embeddings = lambda: model  # what the fingerprint reads
    target = SimpleNamespace(device="cpu", vocab_size=vocab, model=model, tokenizer=None)
    path = folder / "big-recycling.safetensors"
    options = RecyclingDrafter.Options(memory_file=str(path))
    drafter = RecyclingDrafter(options, target)
    drafter.matrix.ids = torch.randint(0, vocab, (vocab, 8), dtype=torch.int32)
    drafter.matrix.probs = torch.rand(vocab, 8)
    saved, loaded = save_then_load(drafter, lambda: RecyclingDrafter(options, target))
    print(f"recycling, every one of {vocab} tokens known (top_k 8): {path.stat().st_size / 1e6:.1f} MB, saved in "
          f"{1e3 * saved:.0f} ms, loaded in {1e3 * loaded:.0f} ms")

    path = folder / "big-suffix.safetensors"
    options = SuffixDrafter.Options(memory_file=str(path))
    drafter = SuffixDrafter(options, target)
    g = torch.Generator().manual_seed(0)
    for row in range(1000):
        drafter.cache.extend(row, torch.randint(0, 4000, (224,), generator=g).tolist())
    saved, loaded = save_then_load(drafter, lambda: SuffixDrafter(options, target))
    print(f"suffix, 1000 cached rows of 224 tokens: {path.stat().st_size / 1e6:.1f} MB, saved in {1e3 * saved:.0f} ms, "
          f"loaded (its index built again) in {1e3 * loaded:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="zoo/python-target")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--warm-prompts", type=int, default=16, help="held-out prompts run before the restart")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    base = draftsman.load({"target": {"path": args.target}, "drafter": {"name": "none"}})
    every = heldout_prompts(base.tokenizer, args.prompts + args.warm_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        restart(base, Path(tmp), every[args.prompts:], every[:args.prompts], args.max_new_tokens)
        cost_at_scale(Path(tmp))


if __name__ == "__main__":
    main()
