"""The target's log-probability of each generated token, read from the verification pass.

Each round's pass already holds the target's logits at the root and at every accepted draft
node, so a token's log-probability costs a gather, not another target pass. Two modes, as vLLM's
`logprobs_mode`:
- "raw" (the default): the model's own distribution (log_softmax of its logits), before
  temperature, top-k/top-p/min-p, penalties and the min_new_tokens EOS mask; what Hugging Face
  `generate(output_logits=True)` gives after a log_softmax.
- "processed": the distribution the token was drawn from, after all of them (-inf for a token
  they rule out); at temperature 0, the penalised and masked logits' log_softmax. What
  reinforcement learning needs for its importance ratios.
Neither depends on the drafter: a token's value is what plain decoding's pass gives it, up to
float rounding (the tree pass attends over the same positions in another order).
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams, processed_logprobs

MODES = ("raw", "processed")


class TokenLogprobs:
    """Per row of a request: the log-probability of each kept token (`values`) and, with `top` > 0,
    the `top` most likely tokens at its position (fewer where the settings rule out the rest) as
    (token id, log-probability), most likely first (`top_tokens`; None without). The engine reads
    each round's block once (`read`) and keeps what each row commits (`keep`)."""

    def __init__(self, rows: int, top: int = 0, mode: str = "raw"):
        if mode not in MODES:
            raise ValueError(f"unknown logprobs mode {mode!r}: use one of {', '.join(MODES)}")
        self.values: list[list[float]] = [[] for _ in range(rows)]
        self.top, self.mode = top, mode
        self.top_tokens: list[list[list[tuple[int, float]]]] | None = [[] for _ in range(rows)] if top else None

    def add_rows(self, count: int) -> None:
        """Rows that join a running batch, numbered after the others."""
        self.values += [[] for _ in range(count)]
        if self.top_tokens is not None:
            self.top_tokens += [[] for _ in range(count)]

    def read(self, logits: torch.Tensor, slots: list[list[int]], tokens: list[list[int]], sampling: SamplingParams):
        """logits: (B, T, V), one round's block: as the target gave them in "raw" mode, penalised
        and masked in "processed" mode. Row b's token j was chosen by the logits at block slot
        slots[b][j] (the root's slot 0, then the accepted nodes'). float32 whatever the logits'
        dtype."""
        width = max(len(row) for row in tokens)

        def padded(rows: list[list[int]]) -> torch.Tensor:
            return torch.tensor([row + [0] * (width - len(row)) for row in rows], device=logits.device)

        chosen = logits.gather(1, padded(slots)[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        logp = chosen.log_softmax(-1) if self.mode == "raw" else processed_logprobs(chosen, sampling)
        values = logp.gather(-1, padded(tokens)[:, :, None])[..., 0].tolist()
        if not self.top:
            return values, None
        best = logp.topk(min(self.top, logp.shape[-1]), dim=-1)
        # A token the settings rule out ("processed": -inf) could not have been drawn: it is left out
        # (else which ruled-out ids fill the list is arbitrary, and JSON has no -Infinity).
        drawable = [[[(i, lp) for i, lp in zip(ids, lps) if lp > float("-inf")] for ids, lps in zip(row_ids, row_lps)]
                    for row_ids, row_lps in zip(best.indices.tolist(), best.values.tolist())]
        return values, drawable

    def keep(self, row: int, round_read, index: int, count: int) -> None:
        """Request row `row` committed the first `count` tokens of the round's row `index`."""
        values, top_tokens = round_read
        self.values[row] += values[index][:count]
        if self.top_tokens is not None:
            self.top_tokens[row] += top_tokens[index][:count]


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompts: list[list[int]], top: int = 0) -> tuple[list, list | None]:
    """The target's raw log-probability of each prompt token given the tokens before it (vLLM's
    prompt_logprobs; what an OpenAI completion with echo reports): per row, None for the first
    token, which nothing predicts, then one value per token; with `top` > 0 also the `top` most
    likely tokens at each position as (token id, log-probability), most likely first. One plain
    forward pass per prompt: no drafter takes part."""
    device = model.get_output_embeddings().weight.device
    values, tops = [], [] if top else None
    for row in prompts:
        ids = torch.tensor([row], device=device)
        logp = model(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
        values.append([None] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        if top:
            best = logp.topk(min(top, logp.shape[-1]), dim=-1)
            tops.append([None] + [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())])
    return values, tops
