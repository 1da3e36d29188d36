"""What verifying a block of drafts costs a hybrid target, against an attention target of the same
shape: how much acceptance speculation needs before it pays there.

Two random models of one size (hidden 512, 8 layers, 32k vocabulary, ~45M parameters): Qwen3.5 with
its usual pattern (three Gated DeltaNet layers to one attention layer) and Qwen3 (all attention).
For each, after a 256-token prefill, the median time of one target pass + accept over a chain of
T = 1, 2, 4, 6 and 8 tokens per row (batch 1 and 4), and its ratio to T = 1. A hybrid pass records
the recurrent state after every token of the block (verifier/recurrent_state.py) so each row can
keep the state after its accepted drafts; in Hugging Face's PyTorch path that is a loop over the
block's tokens. The row "states unrecorded" times the hybrid's same pass without recording (every
token kept, as a prefill): the price of recording. All are timed interleaved in one process.

    python scripts/hybrid_verify_cost.py            # CPU
    python scripts/hybrid_verify_cost.py cuda       # with Hugging Face's kernels where installed
"""
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

from draftsman.verifier.cached_model import CachedLM
from draftsman.verifier.prefill import Prefill
from draftsman.verifier.tree import TreeBlock

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
BLOCKS = [1, 2, 4, 6, 8]
PREFILL = 256
REPEATS = 15


def models():
    torch.manual_seed(0)
    hybrid = Qwen3_5TextConfig(layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                               linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
                               linear_value_head_dim=64, **SHAPE)
    return {"qwen3.5 (hybrid)": AutoModelForCausalLM.from_config(hybrid),
            "qwen3 (attention)": AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE))}


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def pass_ms(lm: CachedLM, rows: int, T: int, recorded: bool) -> float:
    """One verification pass of a T-token chain per row, of which each row keeps half (the caller
    prefills the rows afresh before each, outside the timing). recorded=False: the same pass with
    no states recorded, every token kept (what a prefill does): the price of recording."""
    block = TreeBlock.chains([[7] * T] * rows, lm.device)
    sync()
    start = time.perf_counter()
    lm.forward(block, keep_all=not recorded)
    lm.accept([list(range(T // 2 if recorded else T))] * rows)
    sync()
    return (time.perf_counter() - start) * 1000


def main():
    if DEVICE == "cpu":
        torch.set_num_threads(2)  # this machine's cores; a GPU run leaves torch's own default
    lms = {name: CachedLM(model.to(DEVICE).eval()) for name, model in models().items()}
    runs = [("qwen3.5 (hybrid)", True), ("  states unrecorded", False), ("qwen3 (attention)", True)]
    prompt = list(range(100, 100 + PREFILL))
    for rows in (1, 4):
        times = {run: {T: [] for T in BLOCKS} for run in runs}
        for _ in range(REPEATS):
            for run in runs:  # interleaved: the machine's drift hits all alike
                lm = lms[run[0] if run[1] else "qwen3.5 (hybrid)"]
                for T in BLOCKS:
                    prefill = Prefill(lm, [prompt + [0]] * rows, (), DEVICE)
                    prefill.step()
                    prefill.finish()
                    times[run][T].append(pass_ms(lm, rows, T, recorded=run[1]))
        print(f"\nbatch {rows}, {PREFILL}-token context, {DEVICE}: median ms per pass (ratio to T=1)")
        print(f"{'model':<20}" + "".join(f"{'T=' + str(T):>16}" for T in BLOCKS))
        for run in runs:
            med = {T: statistics.median(times[run][T]) for T in BLOCKS}
            print(f"{run[0]:<20}" + "".join(f"{med[T]:>8.1f} ({med[T] / med[1]:.2f}x)" for T in BLOCKS))


if __name__ == "__main__":
    with torch.no_grad():
        main()
