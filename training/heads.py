"""Train draft heads on a frozen target: `draftsman train medusa|eagle|eagle3|mtp|mlp_speculator --config
training/configs/<kind>.yaml` (`draftsman train pard` adapts a draft model instead: training/pard.py).

The target never trains and is never saved again; its hidden states are computed on the fly for
each batch (no cached features). Labels are either the corpus's next tokens or, by default, the
target's own greedy predictions on that text (self-distillation: the heads learn to agree with the
target, which is what acceptance measures). Checkpoints (heads, optimizer, step) are replaced
atomically every few minutes and a rerun resumes. Accelerate runs the same command on several GPUs.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import corpus as C
from ..heads.common import check_heads_destination
from ..heads.mlp_speculator import MLPSpeculator, load_mlp_speculator
from ..models import DTYPES, context_length, pretrained_text_model, resolve_dtype, tokenizer_fingerprint
from .documents import data_file_digest, document_ids, document_ids_and_reply_mask, read_documents
from .heads_config import (DEFAULTS, KINDS, LATER_KEYS, STEP_DEFAULTS, check_step_keys,  # noqa: F401 (heads'
                           config_with_overrides, merged_config, train_parser)  # own names, as before)
from .pretrain import atomic_np_save, atomic_torch_save, heldout_windows, train_batch, versions
from .processes import accelerator, main_process_decides, step_report
from .threads import restores_torch_threads


def micro_batches(windows: torch.Tensor, learned: torch.Tensor | None, count: int):
    """One step's draw of windows (and its learned-position mask) cut into `count` equal micro-batches,
    so an accumulated step sees the same windows as one batch of their total size."""
    parts = windows.chunk(count)
    return zip(parts, learned.chunk(count) if learned is not None else [None] * count)


def accumulated_backward(micro, loss_of, backward, no_sync, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the mean of the micro-batches' losses, one micro-batch at a time (gradients summed
    in place; `no_sync` keeps several processes from syncing them before the last); returns the
    mean loss and the mean of each accuracy, as tensors still on the device (processes.step_report
    reads them, with one host sync a step). Averaging micro-batch means equals one batch's mean
    when every micro-batch learns as many positions; under assistant_only_loss, where they do not,
    loss_of divides its loss and accuracies by its share of the step's learned positions
    (step_learned_counts) instead."""
    losses, accuracies = [], []
    for i, (x, learned) in enumerate(micro):
        with no_sync() if i < count - 1 else contextlib.nullcontext():
            loss, accuracy = loss_of(x, learned)
            backward(loss / count)
        losses.append(loss.detach())
        accuracies.append(torch.as_tensor(accuracy))
    return torch.stack(losses).mean(), torch.stack(accuracies).mean(0)


def load_config(raw) -> dict:
    cfg = merged_config(raw, DEFAULTS, "heads training config", ("target", "out"))
    if cfg["kind"] not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {cfg['kind']!r}")
    check_heads_destination(cfg["out"], kind=cfg["kind"])  # now, not when the trained heads are saved hours later
    if cfg["labels"] not in ("self_distill", "corpus"):
        raise ValueError(f"labels must be self_distill or corpus, got {cfg['labels']!r}")
    if cfg["target_dtype"] != "auto" and cfg["target_dtype"] not in DTYPES:
        raise ValueError(f"target_dtype must be one of {sorted(DTYPES) + ['auto']}, got {cfg['target_dtype']!r}")
    if cfg["lr_schedule"] not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be constant or cosine, got {cfg['lr_schedule']!r}")
    if cfg["init_from"] and not Path(cfg["init_from"], "config.json").is_file():
        raise FileNotFoundError(f"init_from: no heads config.json in {cfg['init_from']}; point it at a "
                                f"folder written by `draftsman train {cfg['kind']}`, or set init_from: null")
    if cfg["data_file"] and cfg["corpus_root"]:
        raise ValueError("set either data_file (a JSONL of conversations or texts) or corpus_root (a folder of "
                         "source files), not both")
    if not isinstance(cfg["assistant_only_loss"], bool):
        raise ValueError(f"assistant_only_loss must be true or false, got {cfg['assistant_only_loss']!r}")
    if cfg["assistant_only_loss"] and not cfg["data_file"]:
        raise ValueError("assistant_only_loss needs a data_file of conversations: a corpus has no assistant "
                         "replies. Set data_file, or set assistant_only_loss: false")
    from ..heads.feature_head import LAYERS  # checked here too, before a target is loaded

    if cfg["layer"] not in LAYERS:
        raise ValueError(f"layer must be target (a layer of the target's class) or llama (a Llama layer of its "
                         f"sizes, which vLLM and SGLang serve for any target), got {cfg['layer']!r}")
    if cfg["layer"] == "llama" and cfg["kind"] not in ("eagle", "eagle3"):
        raise ValueError(f"layer: llama is for eagle and eagle3 heads; a {cfg['kind']} head keeps the target's own "
                         "layer: set layer: target")
    if cfg["kind"] == "mlp_speculator" and cfg["tie_weights"] and cfg["num_heads"] < 2:
        raise ValueError("tie_weights shares stage 1's weights with the stages after it: set num_heads >= 2 or "
                         "tie_weights: false")
    if cfg["kind"] == "eagle3" and cfg["labels"] != "self_distill":
        raise ValueError("eagle3 heads learn the target's own distribution: set labels: self_distill")
    # Head h (depth h + 1) is learned and measured at seq_len - h - 1 places of a window: a window
    # shorter than the deepest failed at the end of the run (an IndexError, torch's batch sizes).
    deepest = {"medusa": "num_heads", "mlp_speculator": "num_heads", "eagle3": "ttt_steps"}.get(cfg["kind"])
    for key in ([deepest] if deepest else []) + (["eval_depths"] if cfg["kind"] in ("eagle", "eagle3", "mtp") else []):
        if cfg[key] >= cfg["seq_len"]:
            raise ValueError(f"{key} {cfg[key]} needs windows longer than seq_len {cfg['seq_len']} (depth d is learned "
                             f"at seq_len - d places): lower {key} or raise seq_len")
    aux = cfg["aux_layers"]
    if aux is not None and (len(aux) != 3 or not all(type(k) is int for k in aux) or sorted(set(aux)) != aux):
        raise ValueError(f"aux_layers must be 3 different hidden_states indices (whole numbers), low to high, e.g. "
                         f"[2, 16, 29], or null for EAGLE-3's default; got {aux!r}")
    return cfg


def check_against_target(cfg: dict, target: torch.nn.Module) -> None:
    """What only the loaded target can say, said before the corpus is read or a step is taken: keys that
    failed at the end of a run (eval_ranks past the vocabulary) or were quietly cut (draft_vocab)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    for key in ("eval_ranks", "draft_vocab"):
        if cfg.get(key) is not None and cfg[key] > vocab:
            raise ValueError(f"{key} {cfg[key]} is more than the target's {vocab} tokens: lower it"
                             + (" (or set null for all of them)" if key == "draft_vocab" else ""))
    positions = target_positions(target)
    if positions is not None and cfg["seq_len"] > positions:
        raise ValueError(f"seq_len {cfg['seq_len']} is longer than the target's {positions} positions: the heads would "
                         f"learn from positions it was never trained on; set seq_len <= {positions}")


def target_positions(target: torch.nn.Module) -> int | None:
    """The positions the target was trained on, None when its config does not say (nothing to check)."""
    try:
        return context_length(target.config)
    except ValueError:
        return None


def check_eagle3_layer(cfg: dict, target: torch.nn.Module) -> None:
    """An EAGLE-3 head in the target's own layer needs a Llama-like one: refused here, by its fix
    (layer: llama), not by a traceback once the corpus is tokenized and the head is built."""
    if cfg["kind"] != "eagle3" or cfg["layer"] != "target":
        return
    from ..heads.eagle3 import midlayer_problem
    from ..heads.feature_head import decoder_layers

    problems = [midlayer_problem(layer) for layer in decoder_layers(target)]
    if all(problems):  # (a hybrid target's head takes one of its attention layers)
        raise ValueError(problems[0])


def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text; none for no texts (a split no file fell in: training_streams names it)."""
    return tokenizer(texts)["input_ids"] if texts else []


def training_streams(cfg: dict, tokenizer, check_heldout: bool = True):
    """(train, held-out, masks): token streams in the target's tokenizer, documents joined by EOS
    (cached as .npy), from the corpus_root files or the data_file's documents; masks, with
    assistant_only_loss, are 0/1 streams aligned with them, 1 where the token belongs to an
    assistant's reply (training/documents.py), else None (every position counts).
    check_heldout=False: the caller reads only the train stream, so only it must be longer than
    seq_len."""
    streams = _cached_streams(cfg, tokenizer)
    checked = ("train", "heldout") if check_heldout else ("train",)
    for name in checked:
        if len(streams[name]) <= cfg["seq_len"]:
            raise ValueError(f"the {name} split has {len(streams[name])} tokens, no more than seq_len "
                             f"{cfg['seq_len']}: add documents or lower seq_len")
    masks = None
    if cfg["assistant_only_loss"]:
        if not streams["train-replies"].any():
            raise ValueError(f"data_file '{cfg['data_file']}' has no assistant replies in its training split, so "
                             "assistant_only_loss leaves nothing to learn: add conversations with assistant "
                             "messages, or set assistant_only_loss: false")
        masks = streams["train-replies"], streams["heldout-replies"]
    return streams["train"], streams["heldout"], masks


def token_streams(cfg: dict, tokenizer, check_heldout: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """training_streams' train and held-out token streams."""
    return training_streams(cfg, tokenizer, check_heldout)[:2]


def reply_masks(cfg: dict, tokenizer) -> tuple[np.ndarray, np.ndarray] | None:
    """training_streams' reply masks (None without assistant_only_loss)."""
    return training_streams(cfg, tokenizer, check_heldout=False)[2]


def _tokenizer_key(cfg: dict, tokenizer) -> str:
    """The target's folder name (readable) and its tokenizer's fingerprint: two targets in folders of
    one name (checkpoint-1000) tokenize alike only when their tokenizers are alike."""
    return f"{Path(cfg['target']).name}-{len(tokenizer)}-{tokenizer_fingerprint(tokenizer)[:8]}"


def _cached_streams(cfg: dict, tokenizer) -> dict[str, np.ndarray]:
    """The streams of token_streams (and, with assistant_only_loss, reply_masks) by name, built once
    and then read from their .npy caches."""
    if cfg["data_file"]:
        # The file's content and the chat template, not names, key the cache: an edited file or
        # template is tokenized again. The file is parsed only when a cache is missing.
        template = hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()[:8]
        data = Path(cfg["data_file"])
        key = f"{_tokenizer_key(cfg, tokenizer)}-{data.stem}-{data_file_digest(data)}-{template}"
        splits = lambda: read_documents(data)  # noqa: E731
        if cfg["assistant_only_loss"]:
            encode = lambda docs: (document_ids_and_reply_mask(tokenizer, d, cfg["target"]) for d in docs)  # noqa: E731
        else:
            encode = lambda docs: ((document_ids(tokenizer, d, cfg["target"]), None) for d in docs)  # noqa: E731
    else:
        root = Path(cfg["corpus_root"]) if cfg["corpus_root"] else None
        if root is not None and not root.is_dir():  # (it read as "the train split has 0 tokens")
            raise ValueError(f"corpus_root '{root}' is not a folder: point it at a folder of source files, or leave "
                             "it out to train on this interpreter's standard library")
        files = C.split_files(root)
        key = f"{_tokenizer_key(cfg, tokenizer)}-{C.files_digest(files[0] + files[1])}"
        splits = lambda: files  # noqa: E731
        encode = lambda paths: ((ids, None)  # noqa: E731
                                for ids in _encode_texts(tokenizer, list(C.iter_texts(paths))))
    names = ("train", "heldout") + (("train-replies", "heldout-replies") if cfg["assistant_only_loss"] else ())
    work = Path(cfg["work_dir"])
    caches = {name: work / f"heads-{name}-{key}.npy" for name in names}
    if not all(cache.exists() for cache in caches.values()):
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        work.mkdir(parents=True, exist_ok=True)
        for split, docs in zip(("train", "heldout"), splits()):
            ids: list[int] = []
            in_reply: list[int] = []
            for doc_ids, doc_mask in encode(docs):
                ids.extend(doc_ids)
                ids.append(eos)
                if doc_mask is not None:
                    in_reply.extend(doc_mask)
                    in_reply.append(0)  # the separator belongs to no reply
            atomic_np_save(caches[split], np.asarray(ids, dtype=np.int32))
            if cfg["assistant_only_loss"]:
                atomic_np_save(caches[f"{split}-replies"], np.asarray(in_reply, dtype=np.uint8))
    return {name: np.load(cache, mmap_mode="r") for name, cache in caches.items()}


def medusa_loss(head_logits: torch.Tensor, labels: torch.Tensor, decay: float, step_counts=None):
    """head_logits (H, B, L, V): head i at position t predicts labels[:, t + i + 1], where labels[:, s]
    is the token at s + 1 (the next-token label of position s; -100 where there is none to learn).
    Returns the weighted loss and the per-head top-1 accuracy (a tensor). step_counts: masked_mean's."""
    total, accuracy = 0.0, []
    L = labels.shape[1]
    for i, logits in enumerate(head_logits):
        pred = logits[:, : L - i - 1]  # positions that have a label i + 1 steps later
        target = labels[:, i + 1:]
        total = total + decay ** i * masked_cross_entropy(pred, target, step_counts)
        learned = target != -100
        accuracy.append(masked_mean(((pred.argmax(-1) == target) & learned).float().sum(), learned, step_counts))
    return total, torch.stack(accuracy)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, step_counts=None) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100 (masked_mean, with its step_counts)."""
    summed = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100, reduction="sum")
    return masked_mean(summed, labels != -100, step_counts)


def masked_mean(summed: torch.Tensor, keep: torch.Tensor, step_counts: torch.Tensor | None = None) -> torch.Tensor:
    """A loss summed over the positions `keep` marks, as a mean: over keep's own positions, 0 (not
    NaN) where there are none, as in a batch drawn wholly from user turns under assistant_only_loss.
    With step_counts (step_learned_counts of the step this micro-batch belongs to): over this
    micro-batch's share of the step's learned positions in keep's columns. Every loss here reads
    the last columns of its windows (positions s.. L-1: a later head's labels, a later depth's), so
    keep's width says which."""
    if step_counts is None:
        return summed / keep.sum().clamp_min(1)
    return summed / step_counts[-keep.shape[-1]]


def step_learned_counts(learned: torch.Tensor | None, parts: int, summed_over_processes=lambda t: t):
    """Under assistant_only_loss, micro-batches (and processes) learn different numbers of positions,
    so the mean of their own means would weigh a position of a short reply above one of a long
    reply, and a step would differ from one batch of the same windows. From the step's whole draw on
    this process, `learned` (B, L), summed over the processes: per column s, the learned positions
    in columns s.., as a share for each of the `parts` (micro-batches x processes) to divide by
    (masked_mean). The step's loss is then the mean over all its learned positions, however split.
    None without a mask: every micro-batch learns as many positions, and its own mean is right."""
    if learned is None:
        return None
    from_column = learned.sum(0).flip(0).cumsum(0).flip(0).float()  # [s]: learned positions in columns s..
    return summed_over_processes(from_column).clamp_min(1) / parts


def stage_inputs(x: torch.Tensor, stages: int) -> torch.Tensor:
    """(B, L) tokens -> (B, L, stages): an MLP speculator's stage i at position t reads the token
    at t + i + 1 (the root for stage 0); 0 past the window's end, where no label is learned."""
    padded = torch.nn.functional.pad(x, (0, stages))
    return torch.stack([padded[:, i + 1: i + 1 + x.shape[1]] for i in range(stages)], dim=-1)


def heads_logits(heads, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Every head's (stage's) logits (H, B, L, V) on the target's states: Medusa heads read those
    alone, an MLP speculator's stages each the text's token before them too (stage_inputs)."""
    raw = getattr(heads, "module", heads)  # (wrapped by accelerate on several processes)
    if isinstance(raw, MLPSpeculator):
        return heads(hidden, stage_inputs(x, raw.n_predict))
    return heads(hidden)


def learned_positions(in_reply: torch.Tensor | None) -> torch.Tensor | None:
    """(B, L) bool from a reply-mask window: whether position s's label (the token at s + 1) is
    learned. None (no assistant_only_loss): every label is."""
    if in_reply is None:
        return None
    return torch.cat([in_reply[:, 1:], torch.zeros_like(in_reply[:, :1])], dim=1).bool()


def all_positions(x: torch.Tensor) -> torch.Tensor:
    """learned_positions without a mask: every position of x."""
    return torch.ones_like(x, dtype=torch.bool)


def sample_windows(stream, mask, cfg: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed evaluation sample of a stream (eval_tokens of it) and its learned_positions (None
    without a reply mask): the same starts, since the mask is as long as the stream."""
    sample = lambda s: heldout_windows(s, cfg["eval_tokens"], cfg["seq_len"])  # noqa: E731
    return sample(stream), None if mask is None else learned_positions(sample(mask))


@torch.no_grad()
def target_pass(target, x: torch.Tensor, autocast):
    """Frozen target: last hidden states (B, L, d) in float32 and its greedy next tokens (B, L)."""
    with autocast():
        out = target(input_ids=x, output_hidden_states=True)
    return out.hidden_states[-1].float(), out.logits.argmax(-1)


def labels_for(cfg, x, greedy):
    """Next-token label of every position: the corpus's next token or the target's own choice."""
    if cfg["labels"] == "corpus":
        return torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)  # last position has none
    return greedy


@torch.no_grad()
def evaluate_heads(heads, target, windows: torch.Tensor, ranks: int, autocast, batch: int = 4,
                   learned: torch.Tensor | None = None) -> dict:
    """Per head: top-1 / top-5 agreement with the target's greedy token on held-out text, and the
    accuracy of each candidate rank (for tree calibration). learned: learned_positions of the
    windows (only those positions are counted); None counts all."""
    H = heads.n_predict if isinstance(heads, MLPSpeculator) else heads.config.num_heads
    hits = torch.zeros(H, ranks)
    top5 = torch.zeros(H)
    counts = torch.zeros(H)
    device = next(heads.parameters()).device
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch].to(device)
        keep = all_positions(x) if learned is None else learned[i:i + batch].to(device)
        hidden, greedy = target_pass(target, x, autocast)
        logits = heads_logits(heads, hidden, x)
        L = x.shape[1]
        for h in range(H):
            cand = logits[h, :, : L - h - 1].topk(ranks, dim=-1).indices  # (B, L', ranks)
            truth = greedy[:, h + 1:].unsqueeze(-1)
            counted = keep[:, h + 1:]
            match = (cand == truth) & counted[..., None]
            hits[h] += match.float().sum((0, 1)).cpu()
            top5[h] += match[..., :5].any(-1).float().sum().cpu()
            counts[h] += counted.sum().cpu()
    rank_accuracy = (hits / counts.clamp_min(1)[:, None]).tolist()
    return {"top1": [r[0] for r in rank_accuracy], "top5": (top5 / counts.clamp_min(1)).tolist(),
            "rank_accuracy": rank_accuracy}


def frozen_target(cfg: dict, device) -> torch.nn.Module:
    """The target in target_dtype on `device`, never trained (a 7B one is 28 GB in float32, 14 in
    bfloat16: the heads still train in float32, reading its hidden states as float32)."""
    target = pretrained_text_model(cfg["target"], resolve_dtype(cfg["target_dtype"], device), "target")
    return target.to(device).eval().requires_grad_(False)


def in_float32(heads, target):
    """Heads train and are evaluated in float32 whatever the target's dtype. An eagle / mtp head
    reads out through the target's LM head: for a target in another dtype it gets a frozen float32
    copy (never saved: a head's checkpoint holds none of the target)."""
    from ..heads.feature_head import FeatureHead
    heads = heads.float()
    lm_head = target.get_output_embeddings()
    if isinstance(heads, FeatureHead) and heads.config.kind != "eagle3" and lm_head.weight.dtype != torch.float32:
        readout = torch.nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None,
                                  device=lm_head.weight.device)
        readout.load_state_dict({k: v.float() for k, v in lm_head.state_dict().items()})
        heads.body.set_output_embeddings(readout.requires_grad_(False))
    return heads


def build_heads(cfg: dict, target, frequent_order: list[int]):
    """New heads of cfg['kind'], in float32; an EAGLE-3 head's draft vocabulary is the start of
    `frequent_order` (target_token_frequencies)."""
    from ..heads.feature_head import FeatureHead
    from ..heads.medusa import MedusaHeads
    if cfg["kind"] == "medusa":
        heads = MedusaHeads.for_target(target, cfg["num_heads"], cfg["num_layers"], cfg["share_lm_head"])
    elif cfg["kind"] == "mlp_speculator":
        heads = MLPSpeculator.for_target(target, cfg["num_heads"], cfg["inner_dim"], cfg["tie_weights"],
                                         cfg["scale_input"])
    elif cfg["kind"] == "eagle3":
        n = cfg["draft_vocab"] or len(frequent_order)
        heads = FeatureHead.for_target(target, "eagle3", frequent_order[:n], cfg["aux_layers"], layer=cfg["layer"])
    else:
        heads = FeatureHead.for_target(target, cfg["kind"], layer=cfg["layer"])
    return in_float32(heads, target)


def target_token_frequencies(cfg: dict, target, train_stream, autocast, train_mask=None) -> dict:
    """Which tokens the target picks most (greedy), counted on training text, never on held-out
    text: the order draft_vocab and an EAGLE-3 head's vocabulary take their tokens from ("tokens": how
    many tokens the sample held). train_mask: reply_masks' train stream; only the picks inside replies count."""
    from .feature_heads import tokens_by_frequency
    V = target.get_output_embeddings().weight.shape[0]
    windows, learned = sample_windows(train_stream, train_mask, cfg)
    return {**tokens_by_frequency(lambda x: target_pass(target, x.to(target.device), autocast), windows, V,
                                  learned=learned, draft_vocab=cfg.get("draft_vocab")), "tokens": windows.numel()}


def batch_loss(cfg: dict, heads, target, x: torch.Tensor, autocast, generator, learned: torch.Tensor | None = None,
               step_counts: torch.Tensor | None = None):
    """Run the frozen target on a batch and return the heads' loss and per-head / per-step accuracy.
    learned: learned_positions of the batch (assistant_only_loss); None learns every position.
    step_counts: step_learned_counts of the step the batch is a micro-batch of (None: its own mean)."""
    if cfg["kind"] == "eagle3":
        from .eagle3 import aux_target_pass, eagle3_loss
        aux, greedy, logits = aux_target_pass(target, x, getattr(heads, "module", heads).config.aux_layers, autocast)
        return eagle3_loss(heads, aux, x, greedy, logits, cfg, learned, step_counts)
    hidden, greedy = target_pass(target, x, autocast)
    labels = labels_for(cfg, x, greedy)
    if learned is not None:
        labels = labels.masked_fill(~learned, -100)
    if cfg["kind"] in ("medusa", "mlp_speculator"):  # head (stage) i at position t predicts t + i + 2
        return medusa_loss(heads_logits(heads, hidden, x), labels, cfg["loss_decay"], step_counts)
    from .feature_heads import feature_head_loss
    return feature_head_loss(heads, hidden, x, labels, cfg, generator, step_counts)


def heldout_agreement(cfg: dict, heads, target, windows: torch.Tensor, learned: torch.Tensor | None,
                      autocast) -> dict:
    """The heads' agreement with the target's greedy tokens on held-out windows: top-1 and top-5
    per head (Medusa, the MLP speculator's stages, teacher-forced; with each candidate rank's
    accuracy) or per draft depth (EAGLE, EAGLE-3, MTP, chained on their own features)."""
    from .eagle3 import evaluate_eagle3
    from .feature_heads import evaluate_feature_head
    if cfg["kind"] in ("medusa", "mlp_speculator"):
        return evaluate_heads(heads, target, windows, cfg["eval_ranks"], autocast, learned=learned)
    run_target = evaluation_pass(cfg, heads, target, autocast)
    if cfg["kind"] == "eagle3":
        return evaluate_eagle3(heads, run_target, windows, cfg["eval_depths"], learned=learned)
    return evaluate_feature_head(heads, run_target, windows, autocast, cfg["eval_depths"], learned=learned)


def evaluation_pass(cfg: dict, heads, target, autocast):
    """The frozen target's pass a feature head's evaluation reads: EAGLE-3's fused layers, else the
    last hidden states (with the greedy tokens)."""
    if cfg["kind"] == "eagle3":
        from .eagle3 import aux_target_pass
        return lambda x: aux_target_pass(target, x, heads.config.aux_layers, autocast)
    return lambda x: target_pass(target, x.to(target.device), autocast)


def evaluate_and_save(cfg: dict, heads, target, held_sample, autocast, train_stream, frequent: dict | None = None,
                      train_mask=None) -> dict:
    """Held-out agreement on `held_sample` (sample_windows of the held-out stream: windows and their
    learned positions, inside replies under assistant_only_loss), then the heads folder (with what
    the drafter needs from the evaluation). frequent: target_token_frequencies, if the caller
    counted them already. train_mask: the training stream's reply mask, or None."""
    from ..drafters.rank_trees import tree_from_accuracies
    frequent = frequent or target_token_frequencies(cfg, target, train_stream, autocast, train_mask)
    ev = heldout_agreement(cfg, heads, target, *held_sample, autocast)
    if cfg["kind"] == "medusa":
        tree = tree_from_accuracies(ev["rank_accuracy"], cfg["tree_budget"])
        extra = {"rank_accuracy": ev["rank_accuracy"], "tree": [list(p) for p in tree]}
    elif cfg["kind"] == "eagle3":
        from .eagle3 import greedy_score_scale
        # Confidence calibration for greedy trees, fitted on training text (training/eagle3.py).
        scale = greedy_score_scale(heads, evaluation_pass(cfg, heads, target, autocast),
                                   *sample_windows(train_stream, train_mask, cfg), cfg["ttt_steps"])
        extra = {"heldout_agreement": ev, "greedy_score_scale": scale}
    else:
        extra = {"heldout_agreement": ev}
    ev["draft_vocab_coverage"] = frequent["coverage"]
    heads.save(cfg["out"], target, extra={**extra, "tokens_by_frequency": frequent["order"]})
    return ev


def load_heads(cfg: dict, folder, target):
    """Heads of cfg['kind'] saved in `folder`, in float32, refused if they were trained for another target."""
    from ..heads.feature_head import FeatureHead
    from ..heads.medusa import MedusaHeads
    if cfg["kind"] == "medusa":
        heads = MedusaHeads.load(folder, target)[0]
    elif cfg["kind"] == "mlp_speculator":
        heads = load_mlp_speculator(folder, target, "train mlp_speculator")[0]
    else:
        heads = FeatureHead.load(folder, target, kind=cfg["kind"])[0]
    return in_float32(heads, target)


# Keys a run may change and still resume its checkpoint: they decide how a run is watched, saved or
# evaluated, not the steps it takes (under a constant learning rate, not how long it runs either).
RESUMABLE_KEYS = ("threads", "checkpoint_minutes", "work_dir", "eval_every", "eval_tokens", "eval_ranks",
                  "eval_depths", "tree_budget")
RESUMABLE_AT_CONSTANT_LR = ("max_steps", "max_minutes")


def checkpoint_path(cfg: dict, trainer: str) -> Path:
    """The run's checkpoint in work_dir, named by its out folder: the folder's name (readable) and a hash
    of its whole path (two outs of one name in other folders are two runs, not one)."""
    out = Path(cfg["out"]).expanduser().resolve()
    digest = hashlib.sha256(str(out).encode()).hexdigest()[:8]
    return Path(cfg["work_dir"]) / f"ckpt-{trainer}-{out.name}-{digest}.pt"


def resumed_state(ckpt: Path, cfg: dict, module: torch.nn.Module, key: str, opt, say,
                  later_keys: dict = LATER_KEYS, main: bool = True) -> dict:
    """The training state of the checkpoint a run of this config left (module[key] and the optimizer
    restored in place, say(step) called), else a fresh one. later_keys: the trainer's keys added
    since it first wrote checkpoints, with the value they had before. A checkpoint of another config
    is not resumed, and not lost: the main process moves it aside and says which keys changed."""
    if not ckpt.exists():
        return {"step": 0, "elapsed": 0.0, "curve": []}
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        saved_cfg = {**{k: v for k, v in later_keys.items() if k in cfg}, **saved["config"]}
        step = saved["state"]["step"]
    except Exception as e:  # (torch.load raises what its unpickler meets)
        raise ValueError(f"the checkpoint '{ckpt}' cannot be read ({type(e).__name__}: {e}): it is damaged, or not "
                         "one this trainer wrote. Delete it to start this run over") from None
    changed = _changed_keys(saved_cfg, cfg)
    if not changed:
        module.load_state_dict(saved[key])
        opt.load_state_dict(saved["optimizer"])
        say(step)
        return saved["state"]
    if main:
        kept = ckpt.with_name(f"{ckpt.stem}.step{step}.other-config.pt")
        ckpt.replace(kept)
        print(f"the checkpoint of step {step} was saved under another config ("
              + ", ".join(f"{k}: {saved_cfg.get(k)!r} -> {cfg.get(k)!r}" for k in changed)
              + f"), so this run starts at step 0. It is kept as {kept}: to resume it, put those keys back and "
              f"rename it to {ckpt.name}; else delete it", file=sys.stderr)
    return {"step": 0, "elapsed": 0.0, "curve": []}


def _changed_keys(saved: dict, now: dict) -> list[str]:
    free = RESUMABLE_KEYS + (RESUMABLE_AT_CONSTANT_LR if saved.get("lr_schedule", "constant") == "constant" and
                             now.get("lr_schedule", "constant") == "constant" else ())
    return sorted(k for k in set(saved) | set(now) if k not in free and saved.get(k) != now.get(k))


def feature_noise_generator(seed: int, step: int, rank: int, device) -> torch.Generator:
    """EAGLE's feature noise for one step, seeded by (seed, step, rank) as train_batch draws windows:
    a resumed run draws the noise an uninterrupted one would, with no generator state in the checkpoint."""
    # (another multiplier than train_batch's, so the noise is not tied to the window draw's stream)
    return torch.Generator(device=device).manual_seed((seed * 0x85EBCA6B + step * 2_000_003 + rank + 1) % (2**63))


def say_if_noise_restarts(cfg: dict, state: dict, say) -> None:
    """Mark the state as drawing noise by step; a checkpoint written before that (one stream seeded at
    each start) still resumes, but its earlier steps saw other noise, so the run is said not to be
    bit-exact with an uninterrupted one."""
    if state["step"] and "noise_by_step" not in state and cfg["kind"] == "eagle" and cfg["feature_noise"] > 0:
        say(f"[eagle] the checkpoint of step {state['step']} was written before feature noise was drawn by step: "
            "this run goes on, but its weights will not equal an uninterrupted run's bit for bit")
    state["noise_by_step"] = True


def record_step(state: dict, t_start: float, loss: float, accuracy: list[float], pbar) -> None:
    """One step done: the step count and clock, the curve every 10 steps, the progress bar."""
    state["step"] += 1
    state["elapsed"] = time.time() - t_start
    if state["step"] % 10 == 0:
        state["curve"].append([state["step"], round(loss, 4), [round(a, 3) for a in accuracy]])
    pbar.update(1)
    pbar.set_postfix(loss=f"{loss:.3f}", acc=" ".join(f"{a:.2f}" for a in accuracy), refresh=False)


def step_size_line(what: str, cfg: dict, processes: int) -> str:
    """What one optimizer step reads, said once at the start: the effective batch is easy to get
    wrong when micro-batches and processes multiply it."""
    windows = cfg["batch_size"] * cfg["grad_accum_steps"] * processes
    return (f"[{what}] each step: {cfg['batch_size']} window(s) x {cfg['grad_accum_steps']} micro-batch(es) x "
            f"{processes} process(es) = {windows} windows of {cfg['seq_len']} tokens")


def record_heldout(state: dict, top1: list[float], pbar) -> None:
    """A held-out check during training: [step, top-1 per head or depth] on the curve of checks,
    and a line above the progress bar."""
    top1 = [round(a, 4) for a in top1]
    state["evals"].append([state["step"], top1])
    pbar.write(f"step {state['step']}: held-out top-1 " + " ".join(f"{a:.3f}" for a in top1))


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup over warmup_steps steps (0: none, the full rate from the first step)."""
    return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)


def learning_rate_factor(cfg: dict, step: int, elapsed_seconds: float) -> float:
    """Multiplier of cfg['lr'] at `step`: linear warmup, then constant or cosine. The cosine's
    progress is the larger of the step and wall-clock fractions, so a run cut by max_minutes still
    ends its decay (on CPU the clock, not max_steps, usually binds)."""
    warm = warmup_factor(step, cfg["warmup_steps"])
    if cfg["lr_schedule"] == "constant":
        return warm
    progress = step / cfg["max_steps"]
    if cfg["max_minutes"]:
        progress = max(progress, elapsed_seconds / (cfg["max_minutes"] * 60))
    progress = min(1.0, progress)
    floor = cfg["min_lr_ratio"]
    return warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@restores_torch_threads
def evaluate_only(config) -> dict:
    """Held-out agreement of heads already in `out` (and, for Medusa, the tree recalibrated with
    this config's tree_budget, written back into the heads' config): the evaluation and
    calibration command, `draftsman train <kind> --config FILE --eval-only`."""
    from transformers import AutoTokenizer

    cfg = load_config(config)
    torch.set_num_threads(cfg["threads"])
    acc = accelerator(cfg["mixed_precision"])
    if not acc.is_main_process:  # under a launcher: one evaluation, by the main process (each would rewrite `out`)
        return {}
    target = frozen_target(cfg, acc.device)
    check_against_target(cfg, target)
    train_stream, held_stream, masks = training_streams(cfg, AutoTokenizer.from_pretrained(cfg["target"]))
    heads = load_heads(cfg, cfg["out"], target)
    held_sample = sample_windows(held_stream, masks[1] if masks else None, cfg)
    ev = evaluate_and_save(cfg, heads, target, held_sample, acc.autocast, train_stream,
                           train_mask=masks[0] if masks else None)
    return {"kind": cfg["kind"], "heldout_agreement": ev}


@restores_torch_threads
def train(config) -> dict:
    """Train heads of `config['kind']` on a frozen target; write them to `out`; return metrics."""
    from transformers import AutoTokenizer

    cfg = load_config(config)
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    acc = accelerator(cfg["mixed_precision"])
    target = frozen_target(cfg, acc.device)
    check_against_target(cfg, target)
    if not cfg["init_from"]:  # (heads to continue bring their own layer, as heads to evaluate do)
        check_eagle3_layer(cfg, target)
    tokenizer = AutoTokenizer.from_pretrained(cfg["target"])
    train_stream, held_stream, masks = training_streams(cfg, tokenizer)
    train_mask = masks[0] if masks else None
    # Once: building and saving the heads both use it.
    frequent = target_token_frequencies(cfg, target, train_stream, acc.autocast, train_mask)
    if cfg["init_from"]:  # continue training: shape and draft vocabulary come from those heads
        heads = load_heads(cfg, cfg["init_from"], target).train()
        acc.print(f"[{cfg['kind']}] starting from the heads in {cfg['init_from']}")
    else:
        heads = build_heads(cfg, target, frequent["order"])
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg["lr"], weight_decay=0.0)
    ckpt = checkpoint_path(cfg, "heads")
    state = resumed_state(ckpt, cfg, heads, "heads", opt,
                          lambda step: acc.print(f"[{cfg['kind']}] resumed from step {step}"), main=acc.is_main_process)
    heads, opt = acc.prepare(heads, opt)
    raw = acc.unwrap_model(heads)
    acc.print(step_size_line(cfg["kind"], cfg, acc.num_processes) + f"; the target in {target.dtype}")
    say_if_noise_restarts(cfg, state, acc.print)

    t_start, last_ckpt = time.time() - state["elapsed"], time.time()
    held_sample = sample_windows(held_stream, masks[1] if masks else None, cfg)  # eval_every's and the final one
    state.setdefault("evals", [])  # (a checkpoint from before eval_every has none)
    pbar = tqdm(total=cfg["max_steps"], initial=state["step"], desc=f"{cfg['kind']} heads",
                mininterval=1 if sys.stderr.isatty() else 30, disable=not acc.is_main_process)
    while state["step"] < cfg["max_steps"]:
        elapsed = time.time() - t_start
        if cfg["max_minutes"]:
            # The main process's clock for all: a process that stopped alone would leave its peers blocked
            # in the next gradient all-reduce, and one on its own cosine would drift from them.
            elapsed, = main_process_decides(acc, elapsed)
            if elapsed > cfg["max_minutes"] * 60:
                break
        step, count = state["step"], cfg["grad_accum_steps"]
        draw = (step, acc.process_index, cfg["seed"], cfg["batch_size"] * count, cfg["seq_len"])
        x = train_batch(train_stream, *draw).to(acc.device)
        # The mask is as long as the stream, so the same draw gives the same windows of it.
        learned = None if train_mask is None else learned_positions(train_batch(train_mask, *draw)).to(acc.device)
        for group in opt.param_groups:
            group["lr"] = cfg["lr"] * learning_rate_factor(cfg, step, elapsed)
        noise = feature_noise_generator(cfg["seed"], step, acc.process_index, acc.device)
        step_counts = step_learned_counts(learned, count * acc.num_processes, lambda t: acc.reduce(t, "sum"))

        def loss_of(x, learned):
            return batch_loss(cfg, heads, target, x, acc.autocast, noise, learned, step_counts)

        loss, head_acc = step_report(acc, *accumulated_backward(
            micro_batches(x, learned, count), loss_of, acc.backward, lambda: acc.no_sync(heads), count))
        if cfg["grad_clip"]:
            acc.clip_grad_norm_(heads.parameters(), cfg["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        record_step(state, t_start, loss, head_acc, pbar)
        if cfg["eval_every"] and state["step"] % cfg["eval_every"] == 0 and acc.is_main_process:
            record_heldout(state, heldout_agreement(cfg, raw.eval(), target, *held_sample, acc.autocast)["top1"], pbar)
            raw.train()
        if time.time() - last_ckpt >= cfg["checkpoint_minutes"] * 60:
            if acc.is_main_process:
                atomic_torch_save({"config": cfg, "heads": raw.state_dict(), "optimizer": opt.state_dict(),
                                   "state": state}, ckpt)
            last_ckpt = time.time()
    pbar.close()

    metrics = {}
    if acc.is_main_process:
        ev = evaluate_and_save(cfg, raw.eval(), target, held_sample, acc.autocast, train_stream, frequent, train_mask)
        metrics = {"kind": cfg["kind"], "steps": state["step"],
                   "tokens_seen": state["step"] * cfg["batch_size"] * cfg["grad_accum_steps"] * cfg["seq_len"]
                   * acc.num_processes,
                   "train_minutes": round(state["elapsed"] / 60, 2), "heldout_agreement": ev, "curve": state["curve"],
                   "heldout_during_training": state["evals"],
                   "config": cfg, "command": " ".join(sys.argv), "versions": versions()}
        (Path(cfg["out"]) / "metrics.json").write_text(json.dumps(metrics, indent=1))
        ckpt.unlink(missing_ok=True)
    return metrics


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pard"]:  # a draft model adapted for parallel drafting: no target, its own trainer
        from .pard import main as train_pard

        return train_pard(argv[1:])
    return run(train_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`draftsman train KIND` with its flags parsed (heads_config.train_parser)."""
    raw = config_with_overrides(args.config, args.overrides)
    raw.setdefault("kind", args.kind)
    if raw["kind"] != args.kind:
        raise ValueError(f"the config trains {raw['kind']!r} heads but the command asked for {args.kind!r}")
    if args.eval_only:
        report = evaluate_only(raw)
        if report:  # (the main process's)
            print(json.dumps(report)[:4000])
        return 0
    metrics = train(raw)
    if metrics:
        print(json.dumps({k: metrics[k] for k in ("steps", "tokens_seen", "train_minutes", "heldout_agreement")})[:2000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
