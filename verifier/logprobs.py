"""The target's log-probability of each generated token, read from the verification pass.

Each round's pass already holds the target's logits at the root and at every accepted draft
node, so a token's log-probability costs a gather, not another target pass. The values are the
model's own distribution (log_softmax of its logits), before temperature, top-k/top-p/min-p,
penalties and the min_new_tokens EOS mask: vLLM's default ("raw_logprobs"), and what Hugging Face
`generate(output_logits=True)` gives after a log_softmax. They do not depend on the drafter: a
token's value is what plain decoding's pass gives it, up to float rounding (the tree pass attends
over the same positions in another order).
"""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, slots: list[list[int]], tokens: list[list[int]]) -> list[list[float]]:
    """logits: (B, T, V), one round's block. Row b's token j was chosen by the logits at block slot
    slots[b][j] (the root's slot 0, then the accepted nodes'); returns log p(token) per row, in
    float32 whatever the logits' dtype."""
    width = max(len(row) for row in tokens)

    def padded(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], device=logits.device)

    chosen = logits.gather(1, padded(slots)[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    ids = padded(tokens)
    values = chosen.log_softmax(-1).gather(-1, ids[:, :, None])[..., 0].tolist()
    return [row[: len(toks)] for row, toks in zip(values, tokens)]
