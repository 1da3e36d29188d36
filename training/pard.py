"""Adapt a draft model for parallel drafting (PARD): `draftsman train pard --config
training/configs/pard.yaml`.

A parallel draft model reads k - 1 mask tokens after the context and predicts the k next tokens
in one pass (drafters/parallel_draft.py). Training keeps its causal-LM loss (depth 1) and teaches
the masks in the same forward: the window of L tokens is followed by k - 1 groups of L mask
tokens, group g - 1 holding, at position p, the g-th draft of a context that ends at p - g + 1.
Each such element sees that context's tokens and the masks of its own chain (groups 1..g - 1 at
the positions before it), through a 4D mask and explicit position ids, and learns the text's
token after p. So one pass over k * L tokens trains every depth at every position, and an element
computes exactly what the drafter computes for that context (tests/test_parallel_draft.py).

No target is read: PARD is target-independent. For labels that follow a target, train on text it
wrote (`draftsman regenerate`, then data_file). The mask token is a new embedding row past the
tokenizer's ids (config.json `pard_token`, where vLLM and AMD's PARD checkpoints keep it), so it
is never a drafted token. Checkpoints are replaced atomically and a rerun resumes.
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .heads import (accumulated_backward, checkpoint_path, masked_cross_entropy, micro_batches, record_heldout,
                    record_step, resumed_state, step_size_line, training_streams, warmup_factor)
from .heads_config import (LATER_KEYS as HEADS_LATER_KEYS, STEP_DEFAULTS, config_with_overrides, merged_config,
                           pard_parser)
from ..config import read_json_object, read_yaml
from ..drafters.parallel_draft import TRAINED_K_KEY
from .pretrain import atomic_torch_save, heldout_windows, load_fp32, save_hf_folder, train_batch, versions
from .processes import accelerator, main_process_decides, step_report
from .threads import restores_torch_threads

DEFAULTS = {
    "draft": None,  # local HF folder of the causal draft model to adapt (required)
    "out": None,  # folder for the parallel draft model (required)
    "k": 4,  # tokens drafted per pass: the context's next token and one per mask (k - 1 masks)
    "work_dir": "zoo/.work",  # token caches and the resumable checkpoint
    "seed": 0,
    "threads": 2,  # torch.set_num_threads on CPU
    "mixed_precision": "no",  # the model's forward under autocast: "no", "bf16", or "auto" (bf16 where native)
    "corpus_root": None,  # None = the stdlib of this interpreter, train split only
    "data_file": None,  # instead of corpus_root: JSONL of texts or conversations (e.g. `draftsman regenerate`'s)
    "seq_len": 128,  # L: each step reads k * L positions
    "batch_size": 8,
    "lr": 5e-4,
    "warmup_steps": 20,
    **STEP_DEFAULTS,  # grad_accum_steps (1) and grad_clip (None), as for heads
    "max_steps": 1000,  # optimizer steps
    "max_minutes": None,  # wall-clock budget; training stops at whichever limit comes first
    "checkpoint_minutes": 3.0,
    "eval_tokens": 16384,  # held-out tokens for the final per-depth accuracy
    "eval_every": 0,  # optimizer steps between held-out accuracy checks during training (0 = at the end only)
}


# Keys added after PARD checkpoints were written without them, with the value those runs had.
LATER_KEYS = {**HEADS_LATER_KEYS, "mixed_precision": "no"}


def load_config(raw) -> dict:
    if not isinstance(raw, dict):
        raw = read_yaml(raw, "pard training config") or {}
    raw = without_pard_kind(raw)
    cfg = merged_config(raw, DEFAULTS, "pard training config", ("draft", "out"))
    if not Path(cfg["draft"], "config.json").is_file():
        raise FileNotFoundError(f"pard training config: no config.json in draft '{cfg['draft']}': point draft at the "
                                "local Hugging Face folder of a causal LM that shares the target's tokenizer")
    if not isinstance(cfg["k"], int) or cfg["k"] < 2:
        raise ValueError(f"pard training config: k must be an integer >= 2 (k - 1 masks), got {cfg['k']!r}")
    if cfg["k"] >= cfg["seq_len"]:  # (deeper depths had no place in a window: 0.0 accuracy recorded for them)
        raise ValueError(f"pard training config: k {cfg['k']} needs windows longer than seq_len {cfg['seq_len']} "
                         "(depth d is learned at seq_len - d places): lower k or raise seq_len")
    check_pard_destination(Path(cfg["out"]), Path(cfg["draft"]))
    if cfg["data_file"] and cfg["corpus_root"]:
        raise ValueError("set either data_file (a JSONL of conversations or texts) or corpus_root (a folder of "
                         "source files), not both")
    return cfg


def without_pard_kind(raw: dict) -> dict:
    """The config without its `kind` key, which may only say pard (`--set kind=medusa` was dropped
    silently: the heads trainer refuses a kind that differs from the command's too)."""
    kind = raw.get("kind", "pard")
    if kind != "pard":
        raise ValueError(f"the config trains {kind!r} but the command asked for 'pard': run `draftsman train {kind}`, "
                         "or set kind: pard (or drop it)")
    return {key: value for key, value in raw.items() if key != "kind"}


def check_pard_destination(out: Path, draft: Path) -> None:
    """The trained model replaces out as a whole folder: fine for a new folder or an earlier PARD
    model; it would delete the draft model it adapts, or a folder of other things ('zoo')."""
    if out.resolve() == draft.resolve():
        raise ValueError(f"pard training config: out '{out}' is the draft folder: the parallel model would replace "
                         "the model it is adapted from. Set out to a new folder")
    if not out.exists():
        return
    if "pard_token" not in (read_json_object(out / "config.json") or {}):
        raise ValueError(f"pard training config: out '{out}' exists and is no parallel draft model (no config.json "
                         "with a pard_token): the trained model would replace that folder and all it holds. Set out "
                         "to a new folder, or an earlier PARD model's")


def add_mask_token(model: torch.nn.Module) -> int:
    """The model's mask token: config.pard_token if it has one, else a new embedding row (the
    mean of the others) past every id, named there."""
    if getattr(model.config, "pard_token", None) is not None:
        return int(model.config.pard_token)
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows + 1, mean_resizing=True)
    model.config.pard_token = rows
    return rows


@functools.lru_cache(maxsize=4)
def parallel_layout(L: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a window of L tokens and k - 1 mask groups: position ids (k * L,), which element each
    element sees (k * L, k * L) bool, and which elements have a context at all (k * L,): the
    element of group g - 1 at position p drafts from the context ending at p - g + 1 >= 0."""
    p = torch.arange(L)
    depth = torch.arange(k).repeat_interleave(L) + 1  # 1 for the text itself, g for group g - 1
    position = p.repeat(k)
    end = position - depth + 1  # the last context token of each element's chain
    q_depth, k_depth = depth[:, None], depth[None, :]
    q_end, k_end, k_pos = end[:, None], end[None, :], position[None, :]
    text_key = (k_depth == 1) & (k_pos <= q_end)  # the context
    own_chain = (k_depth > 1) & (k_end == q_end) & (k_depth <= q_depth)  # the masks before it, and itself
    valid = end >= 0
    seen = (text_key | own_chain) & valid[:, None]
    seen |= torch.eye(k * L, dtype=torch.bool)  # an element without a context sees itself (no empty softmax row)
    return position, seen, valid


def parallel_logits(model, x: torch.Tensor, mask_token: int, k: int) -> torch.Tensor:
    """(B, L) windows -> logits (k, B, L, V): [d, :, p] predicts the token after p from the context
    ending at p - d (depth d + 1), through d masks."""
    B, L = x.shape
    position, seen, _ = parallel_layout(L, k)
    inputs = torch.cat([x, torch.full((B, (k - 1) * L), mask_token, dtype=x.dtype, device=x.device)], dim=1)
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    out = model(input_ids=inputs, position_ids=position.to(x.device)[None].expand(B, -1),
                attention_mask=additive.to(x.device)[None, None].expand(B, 1, -1, -1))
    return out.logits.view(B, k, L, -1).transpose(0, 1)


def depth_losses(logits: torch.Tensor, x: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over depths of each depth's cross-entropy against the text's next tokens (positions
    with a context and a next token), and each depth's top-1 accuracy. The mask row is no label."""
    k, B, L, _ = logits.shape
    _, _, valid = parallel_layout(L, k)
    next_token = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)  # (B, L)
    labels = torch.where(valid.view(k, 1, L).to(x.device), next_token[None], -100)  # (k, B, L)
    total = sum(masked_cross_entropy(logits[d, ..., :vocab], labels[d]) for d in range(k)) / k
    counted = labels != -100
    hits = ((logits[..., :vocab].argmax(-1) == labels) & counted).sum((1, 2))
    return total, hits / counted.sum((1, 2)).clamp_min(1)  # on the device: read once a step


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, mask_token: int, k: int, vocab: int, batch: int = 8) -> list[float]:
    """Held-out top-1 accuracy of each depth (1 = the causal LM's own next token)."""
    hits, counts = torch.zeros(k), torch.zeros(k)
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        _, accuracy = depth_losses(parallel_logits(model, x, mask_token, k), x, vocab)
        n = len(x)
        hits += accuracy.cpu() * n
        counts += n
    return (hits / counts.clamp_min(1)).tolist()


def draft_streams(cfg: dict):
    """The draft model's tokenizer and its training and held-out token streams, as training splits
    them (the draft's own text: no user turns to skip)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["draft"])
    train_stream, held_stream, _ = training_streams({**cfg, "target": cfg["draft"], "assistant_only_loss": False},
                                                    tokenizer)
    return tokenizer, train_stream, held_stream


@restores_torch_threads
def train(config) -> dict:
    """Adapt cfg['draft'] into a parallel draft model in cfg['out']; return its metrics."""
    cfg = load_config(config)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    tokenizer, train_stream, held_stream = draft_streams(cfg)
    vocab = len(tokenizer)
    # Accelerate: one process, or several under torchrun / accelerate launch, each drawing its own
    # windows and averaging gradients (as the heads trainer does).
    acc = accelerator(cfg["mixed_precision"])
    model = load_fp32(cfg["draft"]).train()
    mask_token = add_mask_token(model)
    model.to(acc.device)  # before the optimizer: a resumed state is loaded onto its parameters' device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    ckpt = checkpoint_path(cfg, "pard")
    state = resumed_state(ckpt, cfg, model, "model", opt, lambda step: acc.print(f"[pard] resumed from step {step}"),
                          LATER_KEYS, main=acc.is_main_process)
    model, opt = acc.prepare(model, opt)
    raw = acc.unwrap_model(model)
    acc.print(step_size_line("pard", cfg, acc.num_processes))
    t_start, last_ckpt = time.time() - state["elapsed"], time.time()
    held_windows = heldout_windows(held_stream, cfg["eval_tokens"], cfg["seq_len"]).to(acc.device)
    state.setdefault("evals", [])  # (a checkpoint from before eval_every has none)

    def loss_of(x, _learned):  # every position is learned: the text has no user turns to skip
        with acc.autocast():
            logits = parallel_logits(model, x, mask_token, cfg["k"])
        return depth_losses(logits, x, vocab)

    def held_out_accuracy():
        with acc.autocast():
            return evaluate(raw.eval(), held_windows, mask_token, cfg["k"], vocab)

    pbar = tqdm(total=cfg["max_steps"], initial=state["step"], desc="pard",
                mininterval=1 if sys.stderr.isatty() else 30, disable=not acc.is_main_process)
    while state["step"] < cfg["max_steps"]:
        # The main process's clock decides for all (training/processes.py).
        if cfg["max_minutes"] and main_process_decides(acc, time.time() - t_start > cfg["max_minutes"] * 60)[0]:
            break
        step, count = state["step"], cfg["grad_accum_steps"]
        draw = (step, acc.process_index, cfg["seed"], cfg["batch_size"] * count, cfg["seq_len"])
        x = train_batch(train_stream, *draw).to(acc.device)
        for group in opt.param_groups:
            group["lr"] = cfg["lr"] * warmup_factor(step, cfg["warmup_steps"])
        loss, accuracy = step_report(acc, *accumulated_backward(
            micro_batches(x, None, count), loss_of, acc.backward, lambda: acc.no_sync(model), count))
        if cfg["grad_clip"]:
            acc.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        record_step(state, t_start, loss, accuracy, pbar)
        if cfg["eval_every"] and state["step"] % cfg["eval_every"] == 0 and acc.is_main_process:
            record_heldout(state, held_out_accuracy(), pbar)
            model.train()
        if time.time() - last_ckpt >= cfg["checkpoint_minutes"] * 60:
            if acc.is_main_process:
                atomic_torch_save({"config": cfg, "model": raw.state_dict(), "optimizer": opt.state_dict(),
                                   "state": state}, ckpt)
            last_ckpt = time.time()
    pbar.close()
    if not acc.is_main_process:
        return {}
    heldout = held_out_accuracy()
    setattr(raw.config, TRAINED_K_KEY, cfg["k"])  # the drafter warns when asked to draft deeper
    save_hf_folder(raw, Path(cfg["draft"]), Path(cfg["out"]))
    order = Path(cfg["draft"], "tokens_by_frequency.json")  # the target's picks (draft_vocab): still this model's
    if order.is_file():
        shutil.copyfile(order, Path(cfg["out"], order.name))
    metrics = {"kind": "pard", "steps": state["step"], "k": cfg["k"], "pard_token": mask_token,
               "tokens_seen": state["step"] * cfg["batch_size"] * cfg["grad_accum_steps"] * cfg["seq_len"]
               * acc.num_processes,
               "train_minutes": round(state["elapsed"] / 60, 2), "heldout_accuracy_by_depth": heldout,
               "curve": state["curve"], "heldout_during_training": state["evals"], "config": cfg,
               "command": " ".join(sys.argv), "versions": versions()}
    (Path(cfg["out"]) / "metrics.json").write_text(json.dumps(metrics, indent=1))
    ckpt.unlink(missing_ok=True)
    return metrics


@restores_torch_threads
def evaluate_only(config) -> dict:
    """Held-out accuracy by depth of the parallel draft model already in `out`, on the held-out windows
    training's final evaluation reads: `draftsman train pard --config FILE --eval-only`."""
    cfg = load_config(config)
    out = Path(cfg["out"])
    if not out.is_dir():  # (load_config refuses an out that is something else)
        raise ValueError(f"pard training config: out '{out}' holds no parallel draft model to evaluate: train one "
                         "there first (drop --eval-only), or point out at one")
    torch.set_num_threads(cfg["threads"])
    acc = accelerator(cfg["mixed_precision"])
    if not acc.is_main_process:  # under a launcher: one evaluation, by the main process
        return {}
    tokenizer, _, held_stream = draft_streams(cfg)
    model = load_fp32(out).to(acc.device).eval()
    held_windows = heldout_windows(held_stream, cfg["eval_tokens"], cfg["seq_len"]).to(acc.device)
    with acc.autocast():
        heldout = evaluate(model, held_windows, int(model.config.pard_token), cfg["k"], len(tokenizer))
    return {"kind": "pard", "k": cfg["k"], "heldout_accuracy_by_depth": heldout}


def main(argv=None) -> int:
    return run(pard_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`draftsman train pard` with its flags parsed (heads_config.pard_parser)."""
    if args.eval_only:
        report = evaluate_only(config_with_overrides(args.config, args.overrides))
        if report:  # (the main process's)
            print(json.dumps(report))
        return 0
    metrics = train(config_with_overrides(args.config, args.overrides))
    if not metrics:  # not the main process
        return 0
    print(json.dumps({k: metrics[k] for k in ("steps", "tokens_seen", "train_minutes",
                                              "heldout_accuracy_by_depth")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
