"""What a target with sliding-window layers holds and costs at long contexts, with its cache's
local layers trimmed to about a window (CachedLM trim_windows, the engine's default) and without.

A random Gemma 3-shaped model (hidden 512, 12 layers: five sliding-window layers of 256 to one
full layer, 32k vocabulary) generates NEW tokens after a PROMPT-token prompt, batch 1 and 4, and
after a ragged pair (PROMPT and 128 tokens), with plain decoding and with `ngram` trees (holes,
compaction). For each setting: the most KV storage
the target's cache held after any round (MB, its layers' capacity), and tokens/s, trimmed and
untrimmed runs interleaved in one process (medians of REPEATS), their ratio, and whether both
gave the same tokens.

    python scripts/window_trim_cost.py            # CPU
    python scripts/window_trim_cost.py cuda
    python scripts/window_trim_cost.py cpu ragged # the ragged pair only
    python scripts/window_trim_cost.py cpu draft  # the draft model's cache instead (below)
    python scripts/window_trim_cost.py cpu cross  # a cross_tokenizer draft model's cache (below)

`draft`: the same model drafts for itself (`draft_model`, k=4: every draft accepted, so the
draft model runs as long as the target) and the draft model's cache is trimmed or not (it keeps
k positions more than a window, as a round's rollback goes back so far; the target's is trimmed
in both): the most KV storage the draft cache held, and tokens/s.

`cross`: the same with `cross_tokenizer` (its cache keeps k + 9 positions more than a window, for
the ids a round re-encodes), the model and its prompts in the bundled tokenizer's 8192 ids
(zoo/python-target's tokenizer beside it): the draft model reads the target's text through it.
"""
import statistics
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

import draftsman
from draftsman.verifier.cached_model import SlotLayer

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
ONLY = sys.argv[2] if len(sys.argv) > 2 else None
PROMPT, NEW, REPEATS, WINDOW = 512, 512, 3, 256


def target_folder(vocab_size: int = 32000, tokenizer: str | None = None) -> str:
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                              layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
                              max_position_embeddings=4096, initializer_range=0.1)
    folder = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer is not None:
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return folder


def held_mb(cache) -> float:
    """Bytes of key / value storage the cache's attention layers hold (their capacity)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SlotLayer) and layer._k is not None:
            total += layer._k.numel() * layer._k.element_size() + layer._v.numel() * layer._v.element_size()
    return total / 2 ** 20


def run(dec, prompts, trim: bool, lm=None):
    lm = lm or dec.engine.target
    lm.trim_windows = trim
    most = [0.0]
    compact = lm._maybe_compact

    def measured(*args, **kwargs):  # after each round's accept
        compact(*args, **kwargs)
        most[0] = max(most[0], held_mb(lm.cache))

    lm._maybe_compact = measured
    start = time.perf_counter()
    out = dec.generate(input_ids=prompts, max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del lm._maybe_compact
    return out.token_ids, sum(map(len, out.token_ids)) / seconds, most[0]


def main():
    cross = ONLY == "cross"
    folder = target_folder(8192, "zoo/python-target") if cross else target_folder()
    torch.manual_seed(1)
    # Repeating prompts, so ngram drafts trees that are partly accepted
    base = torch.randint(100, 8000 if cross else 30000, (4, 64)).tolist()
    prompts = [(row * (PROMPT // 64 + 1))[:PROMPT] for row in base]
    print(f"device {DEVICE}, prompt {PROMPT}, new {NEW}, window {WINDOW}, median of {REPEATS}")
    print("| drafter | batch | most KV MB trimmed / untrimmed | tokens/s trimmed / untrimmed | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    own_cache = ONLY in ("draft", "cross")  # the draft model's cache is measured, not the target's
    if own_cache:
        drafters = [{"name": "cross_tokenizer" if cross else "draft_model", "path": folder, "k": 4}]
    else:
        drafters = [{"name": "none"}, {"name": "ngram"}]
    for drafter in drafters:
        name = drafter["name"] + (" (its cache)" if own_cache else "")
        dec = draftsman.load({"target": {"path": folder, "device": DEVICE}, "drafter": drafter})
        for batch in ("1", "4", "ragged"):
            if ONLY not in (None, "draft", "cross", batch) or (own_cache and batch == "ragged"):
                continue
            rows = [prompts[0], prompts[1][:128]] if batch == "ragged" else prompts[:int(batch)]
            results = {True: [], False: []}
            for _ in range(REPEATS):
                for trim in (True, False):
                    results[trim].append(run(dec, rows, trim, dec.drafter.lm if own_cache else None))
            same = all(a[0] == b[0] for a, b in zip(results[True], results[False]))
            speed = {t: statistics.median(r[1] for r in results[t]) for t in results}
            most = {t: max(r[2] for r in results[t]) for t in results}
            print(f"| {name} | {batch} | {most[True]:.1f} / {most[False]:.1f} "
                  f"| {speed[True]:.1f} / {speed[False]:.1f} | {speed[True] / speed[False]:.2f}x | {same} |")


if __name__ == "__main__":
    main()
