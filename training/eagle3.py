"""EAGLE-3 training: the target's distribution as the label, and the "training-time test".

Drafting feeds the head its own outputs from depth 2 on, so training does too. For a window x run
through the frozen target (aux states A at the fused layers, distributions p), step j = 0..S-1
gives every position i the input

  step 0   (fuse(A_i), x_{i+1})            the true features, as after every verification
  step j   (o^{j-1}_i, x_{i+1+j})          the head's own output at step j-1, and the next token

and asks for p at text position i+1+j. Attention is what the drafter's cache holds at that
moment: the true entries of positions 0..i (step 0) plus this position's own chain (steps 1..j),
so each step runs on top of the previous steps' keys with a block mask. Step j's loss weighs
`ttt_decay ** j`.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from ..verifier.hf_compat import cache_kwarg
from .heads import all_positions, masked_mean


@torch.no_grad()
def aux_target_pass(target, x: torch.Tensor, layers, autocast):
    """Frozen target: its hidden_states at `layers` side by side (B, L, 3d), its greedy next tokens
    (B, L) and its logits (B, L, V), in float32."""
    with autocast():
        out = target(input_ids=x, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k].float() for k in layers], dim=-1)
    return aux, out.logits.argmax(-1), out.logits.float()


def _ttt_mask(n: int, step: int, dtype, device) -> torch.Tensor:
    """(1, 1, n, (step + 1) n) additive mask: step-0 keys causally, later steps' keys on the diagonal."""
    allowed = [torch.ones(n, n, dtype=torch.bool, device=device).tril()]
    allowed += [torch.eye(n, dtype=torch.bool, device=device)] * step
    mask = torch.zeros(n, (step + 1) * n, dtype=dtype, device=device)
    return mask.masked_fill_(~torch.cat(allowed, dim=1), torch.finfo(dtype).min)[None, None]


def unroll(head, aux: torch.Tensor, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits over the draft vocabulary, (B, L-1, n) per step: entry i of step j predicts the
    target's token at text position i+1+j (meaningful while i+1+j < L)."""
    module = getattr(head, "module", head)  # unwrapped (Accelerate's DDP) for its attributes
    B, L = x.shape
    n = L - 1
    padded = torch.cat([x, x[:, -1:].expand(B, steps)], dim=1)  # tokens past the end: ignored by the loss
    cache = DynamicCache(config=module.body.config)
    cache_arg = {cache_kwarg(module.body): cache}
    features = aux[:, :n]
    out = []
    for j in range(steps):
        positions = (torch.arange(n, device=x.device) + j)[None].expand(B, n)
        mask = _ttt_mask(n, j, module.fuse.weight.dtype, x.device).expand(B, 1, n, (j + 1) * n)
        features, logits = head(features, padded[:, 1 + j: 1 + j + n], position_ids=positions, attention_mask=mask,
                                use_cache=True, **cache_arg)
        out.append(logits)
    return out


def eagle3_loss(head, aux: torch.Tensor, x: torch.Tensor, greedy: torch.Tensor, target_logits: torch.Tensor,
                cfg: dict, learned: torch.Tensor | None = None, step_counts: torch.Tensor | None = None):
    """Weighted soft cross-entropy against the target's distribution restricted (and renormalised)
    to the draft vocabulary, over `ttt_steps` steps. Returns the loss and the top-1 agreement with
    the target's greedy token per step (a tensor). learned (B, L) bool: the text positions whose next token is
    learned (assistant_only_loss); None: all. step_counts: masked_mean's (training/heads.py)."""
    ids = getattr(head, "module", head).draft_token_ids
    L = x.shape[1]
    learned = all_positions(x) if learned is None else learned
    total, accuracy = 0.0, []
    for j, logits in enumerate(unroll(head, aux, x, cfg["ttt_steps"])):
        m = L - 1 - j  # entries whose label lies inside the window
        if m <= 0:
            break
        p = target_logits[:, 1 + j: 1 + j + m][..., ids].softmax(-1)
        log_q = logits[:, :m].float().log_softmax(-1)
        keep = learned[:, 1 + j: 1 + j + m]
        total = total + cfg["ttt_decay"] ** j * masked_mean((-(p * log_q).sum(-1) * keep).sum(), keep, step_counts)
        hits = (ids[logits[:, :m].argmax(-1)] == greedy[:, 1 + j: 1 + j + m]) & keep
        accuracy.append(masked_mean(hits.sum().float(), keep, step_counts))
    return total, torch.stack(accuracy)


@torch.no_grad()
def evaluate_eagle3(head, run_target, windows: torch.Tensor, depths: int, batch: int = 4,
                    learned: torch.Tensor | None = None) -> dict:
    """Held-out top-1 / top-5 agreement with the target's greedy token by draft depth, through the
    same unrolling the drafter's cache reproduces (depth k = step k - 1). learned: which positions'
    next tokens count; None: all."""
    top1, top5, counts = torch.zeros(depths), torch.zeros(depths), torch.zeros(depths)
    ids = head.draft_token_ids
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(ids.device)
        keep = all_positions(x) if learned is None else learned[i:i + batch].to(x.device)
        aux, greedy, _ = run_target(x)
        L = x.shape[1]
        for k, logits in enumerate(unroll(head, aux, x, depths)):
            m = L - 1 - k
            if m <= 0:
                break
            cand = ids[logits[:, :m].topk(5, dim=-1).indices]
            truth = greedy[:, 1 + k: 1 + k + m]
            counted = keep[:, 1 + k: 1 + k + m]
            top1[k] += ((cand[..., 0] == truth) & counted).float().sum().cpu()
            top5[k] += ((cand == truth[..., None]).any(-1) & counted).float().sum().cpu()
            counts[k] += counted.sum().cpu()
    return {"top1": (top1 / counts.clamp_min(1)).tolist(), "top5": (top5 / counts.clamp_min(1)).tolist()}


@torch.no_grad()
def greedy_score_scale(head, run_target, windows: torch.Tensor, learned: torch.Tensor | None, depths: int,
                       batch: int = 4) -> float:
    """Temperature scaling (Guo et al. 2017) for greedy trees: the s for which softmax(s * logits)
    best predicts the target's *greedy* token (least cross-entropy, over depths 1..`depths`).

    The head learns the target's distribution, whose top probability understates how often its
    top token is the target's argmax; the EAGLE-2 tree ranks nodes by these confidences, so at
    T=0 it ranks by the scaled ones (drafters/eagle.py). Fit on training text, at the positions
    `learned` keeps (None: all)."""
    ids = head.draft_token_ids
    position = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
    position[ids] = torch.arange(len(ids), device=ids.device)
    logits_seen, labels_seen = [], []
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(ids.device)
        counted = all_positions(x) if learned is None else learned[i:i + batch].to(x.device)
        aux, greedy, _ = run_target(x)
        for k, logits in enumerate(unroll(head, aux, x, depths)):
            m = x.shape[1] - 1 - k
            labels = position[greedy[:, 1 + k: 1 + k + m]].reshape(-1)
            keep = (labels >= 0) & counted[:, 1 + k: 1 + k + m].reshape(-1)  # and the greedy token is drafted
            logits_seen.append(logits[:, :m].reshape(-1, logits.shape[-1])[keep].float())
            labels_seen.append(labels[keep])
    logits, labels = torch.cat(logits_seen), torch.cat(labels_seen)
    grid = torch.logspace(-0.5, 1.0, 31).tolist()  # 0.32 .. 10
    losses = [torch.nn.functional.cross_entropy(s * logits, labels).item() for s in grid]
    return round(grid[min(range(len(grid)), key=losses.__getitem__)], 3)
