"""Pretrain the bundled demo pair (target + draft) on the Python stdlib.

    python -m draftsman.training.pretrain --config training/configs/pretrain.yaml [--only STAGE] [--out zoo]

Stages run in order: tokenizer -> draft -> target -> pair (greedy agreement + zoo README).
Each model stage is resumable: a checkpoint (model, optimizer, scheduler, step, planned total
steps, RNG) is replaced atomically every few minutes; rerunning the same command continues it.
A finished stage is skipped when its output folder's metrics.json records the same config.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..atomic_files import replaced_whole
from ..config import read_yaml
from . import corpus as C
from . import tokenizer as T
from .processes import accelerator, main_process_decides
from .threads import restores_torch_threads

STAGES = ("tokenizer", "draft", "target", "pair")

# Every accepted key with its default; the YAML may only use these (typos raise).
MODEL_DEFAULTS = {
    "hidden_size": 512,
    "num_layers": 6,
    "num_heads": 8,
    "num_kv_heads": None,  # None = num_heads (plain multi-head attention)
    "intermediate_size": 1376,
    "tie_embeddings": False,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "seq_len": 512,
    "batch_size": 16,
    "lr": 1e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 100,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "max_steps": 100000,
    "max_minutes": None,
    "probe_steps": 10,
    "replan_every": 25,
    "eval_minutes": 6.0,
}
DEFAULTS = {
    "seed": 1234,
    "out": "zoo",
    "work_dir": "zoo/.work",
    "threads": 2,
    "mixed_precision": "no",
    "checkpoint_minutes": 3.0,
    "corpus": {"root": None, "heldout_percent": C.HELDOUT_PERCENT},
    "tokenizer": {"vocab_size": 8192, "min_frequency": 2},
    "eval": {"heldout_tokens": 200000, "periodic_tokens": 32768, "seq_len": 512, "small_tokens": 4096,
             "batch_size": 16},
    "models": {"draft": MODEL_DEFAULTS, "target": MODEL_DEFAULTS},
}


def _merge(user: dict, defaults: dict, where: str) -> dict:
    unknown = set(user) - set(defaults)
    if unknown:
        raise ValueError(f"unknown config key(s) {sorted(unknown)} in {where}; valid keys: {sorted(defaults)}")
    out = {}
    for k, d in defaults.items():
        v = user.get(k, d)
        if isinstance(d, dict):
            v = _merge(v or {}, d, f"{where}.{k}")
        out[k] = v
    return out


def load_config(path_or_dict) -> dict:
    raw = path_or_dict
    if not isinstance(raw, dict):
        raw = read_yaml(path_or_dict, "pretrain config") or {}
    return _merge(raw, DEFAULTS, "config")


# ---------------------------------------------------------------- data

def _tok_hash(tok_dir: Path) -> str:
    return hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:12]


def token_stream(files, tok_dir: Path, cache: Path) -> np.ndarray:
    """Files joined by EOT into one uint16/uint32 id stream, cached as .npy at `cache` (its name says
    which tokenizer and corpus)."""
    if cache.exists():
        return np.load(cache, mmap_mode="r")
    tok = T.load_tokenizer(tok_dir)
    eot = tok.token_to_id(C.EOT)
    texts = list(C.iter_texts(files))
    ids: list[int] = []
    for enc in tok.encode_batch(texts):  # batch: uses both cores
        ids.extend(enc.ids)
        ids.append(eot)
    dtype = np.uint16 if tok.get_vocab_size() <= 65535 else np.uint32
    arr = np.asarray(ids, dtype=dtype)
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_np_save(cache, arr)
    return arr


def atomic_np_save(path: Path, array: np.ndarray) -> None:
    """np.save through a temporary file of this process's own (several training processes may write
    the same token cache at once on a first run), removed if the write fails or is interrupted."""
    with replaced_whole(path, f"{path.stem}.{os.getpid()}.tmp.npy") as tmp:
        np.save(tmp, array)


def heldout_windows(stream: np.ndarray, n_tokens: int, seq_len: int) -> torch.Tensor:
    """Fixed eval sample: n_tokens//seq_len windows at evenly spaced starts over the whole held-out
    stream (representative of all files, not just the alphabetically first ones)."""
    n = max(1, min(n_tokens, len(stream)) // seq_len)
    starts = np.linspace(0, len(stream) - seq_len, n).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(stream[s:s + seq_len], dtype=np.int64) for s in starts]))


def train_batch(stream: np.ndarray, step: int, rank: int, seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """Random windows drawn from a generator seeded by (seed, step, rank): the data position is just
    the step, so resuming needs no sampler state and every rank sees different data."""
    g = torch.Generator().manual_seed((seed * 0x9E3779B1 + step * 1_000_003 + rank) % (2**63))
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=g).tolist()
    return torch.from_numpy(np.stack([np.asarray(stream[s:s + seq_len], dtype=np.int64) for s in starts]))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int = 16, autocast=None) -> float:
    """Mean next-token loss (nats/token) over all predicted positions of the windows."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size].to(dev)
        ctx = autocast() if autocast else _null()
        with ctx:
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------- models

def build_model(m: dict, vocab_size: int, eot_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=m["hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"] or m["num_heads"],
        intermediate_size=m["intermediate_size"],
        max_position_embeddings=m["max_position_embeddings"],
        rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_embeddings"],
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    return LlamaForCausalLM(cfg)


def lr_lambda_factory(state: dict, m: dict):
    """Linear warmup then cosine to min_lr_ratio over state['total_steps'] (read lazily: the total is
    only fixed after the timing probe, which runs inside warmup)."""
    def f(step: int) -> float:
        w = m["warmup_steps"]
        if step < w:
            return (step + 1) / w
        total = state["total_steps"] or m["max_steps"]
        p = min(1.0, (step - w) / max(1, total - w))
        return m["min_lr_ratio"] + (1 - m["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * p))
    return f


def atomic_torch_save(obj, path: Path):
    """A checkpoint: a kill mid-write leaves the previous one intact; Ctrl-C leaves no half file."""
    with replaced_whole(path) as tmp:
        torch.save(obj, tmp)


def save_hf_folder(model, tok_dir: Path, out_dir: Path):
    """bf16 safetensors + config + generation_config + tokenizer; swapped in as a whole, so only
    over an earlier model: a folder without a config.json is someone's files, not a model."""
    from transformers import AutoTokenizer, GenerationConfig

    if out_dir.exists() and not (out_dir / "config.json").is_file():
        raise ValueError(f"'{out_dir}' exists and holds no model (no config.json): saving the model there would "
                         "replace the folder and all it holds. Save to a new folder")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    m = copy.deepcopy(model).to("cpu", torch.bfloat16)
    m.config.dtype = "bfloat16"
    c = m.config
    m.generation_config = GenerationConfig(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                                           pad_token_id=c.pad_token_id)
    m.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(tmp)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_fp32(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def versions() -> dict:
    import accelerate
    import tokenizers
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "tokenizers": tokenizers.__version__}


# ---------------------------------------------------------------- stages

class Ctx:
    """Paths and data shared by the stages of one run."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.out = Path(cfg["out"])
        self.work = Path(cfg["work_dir"])
        self.root = Path(cfg["corpus"]["root"]) if cfg["corpus"]["root"] else C.stdlib_root()
        self.train_files, self.held_files = C.split_files(self.root, cfg["corpus"]["heldout_percent"])
        self.tok_dir = self.work / "tokenizer"

    def streams(self):
        h = f"{_tok_hash(self.tok_dir)}-{C.files_digest(self.train_files + self.held_files)}"  # tokenizer, corpus
        tr = token_stream(self.train_files, self.tok_dir, self.work / f"train-{h}.npy")
        he = token_stream(self.held_files, self.tok_dir, self.work / f"heldout-{h}.npy")
        return tr, he

    def corpus_info(self) -> dict:
        return {"root": str(self.root), "python_version": C.python_version() if not self.cfg["corpus"]["root"] else None,
                "train_files": len(self.train_files), "heldout_files": len(self.held_files),
                "heldout_percent": self.cfg["corpus"]["heldout_percent"],
                "split": "sha256(relative posix path)[:8] % 100 < heldout_percent -> held out"}


def stage_tokenizer(ctx: Ctx) -> dict:
    t0 = time.time()
    tc = ctx.cfg["tokenizer"]
    tok = T.train_tokenizer(C.iter_texts(ctx.train_files), tc["vocab_size"], tc["min_frequency"])
    T.save_tokenizer(tok, ctx.tok_dir)
    tr, he = ctx.streams()
    info = {"vocab_size": tok.get_vocab_size(), "train_tokens": int(len(tr)), "heldout_tokens": int(len(he)),
            "seconds": round(time.time() - t0, 1)}
    print(f"[tokenizer] {info}", flush=True)
    return info


def stage_model(ctx: Ctx, name: str, command: str, stop_after: int | None = None) -> dict | None:
    from tqdm import tqdm

    cfg, m = ctx.cfg, ctx.cfg["models"][name]
    out_dir = ctx.out / f"python-{name}"
    stage_cfg = {"model": m, "seed": cfg["seed"], "tokenizer": cfg["tokenizer"], "eval": cfg["eval"],
                 "mixed_precision": cfg["mixed_precision"], "corpus": cfg["corpus"]}
    done = out_dir / "metrics.json"
    if done.exists() and json.loads(done.read_text()).get("config") == stage_cfg:
        print(f"[{name}] already trained with this config: {out_dir} (delete it to retrain)", flush=True)
        return json.loads(done.read_text())

    acc = accelerator(cfg["mixed_precision"])
    torch.manual_seed(cfg["seed"])
    train, held = ctx.streams()
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(ctx.tok_dir)
    model = build_model(m, len(hf_tok), hf_tok.eos_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    # No weight decay on norms and biases (standard; decaying RMSNorm gains hurts small models).
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": m["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=m["lr"], betas=(0.9, 0.95))
    state = {"step": 0, "total_steps": None if m["max_minutes"] else m["max_steps"], "train_curve": [],
             "heldout_curve": [], "elapsed": 0.0, "resumed_from": []}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(state, m))

    ckpt = ctx.work / f"ckpt-{name}.pt"
    if ckpt.exists():
        s = torch.load(ckpt, map_location="cpu", weights_only=False)
        if s["config"] == stage_cfg:
            model.load_state_dict(s["model"])
            opt.load_state_dict(s["optimizer"])
            sched.load_state_dict(s["scheduler"])
            state.update(s["state"])
            torch.set_rng_state(s["rng"])
            state["resumed_from"].append(state["step"])
            acc.print(f"[{name}] resumed from step {state['step']}")
        else:
            acc.print(f"[{name}] ignoring checkpoint with a different config")
    model, opt = acc.prepare(model, opt)  # the scheduler stays ours: its lambda is step-based
    raw = acc.unwrap_model(model)

    ev = cfg["eval"]
    eval_windows = heldout_windows(held, ev["heldout_tokens"], ev["seq_len"])
    periodic_windows = heldout_windows(held, ev["periodic_tokens"], ev["seq_len"])
    tokens_per_step = m["batch_size"] * m["seq_len"] * acc.num_processes

    def evaluate():
        if acc.is_main_process:
            t = time.time()
            loss = heldout_loss(raw, periodic_windows, ev["batch_size"], acc.autocast)
            state["heldout_curve"].append([state["step"], state["step"] * tokens_per_step, round(loss, 4)])
            state["eval_seconds"] = time.time() - t
            tqdm.write(f"[{name}] step {state['step']} heldout loss {loss:.4f} (eval {state['eval_seconds']:.0f}s, "
                       f"{(time.time() - t_start) / 60:.1f} min)")
        acc.wait_for_everyone()

    def checkpoint():
        acc.wait_for_everyone()
        if acc.is_main_process:
            atomic_torch_save({"config": stage_cfg, "model": raw.state_dict(), "optimizer": opt.state_dict(),
                               "scheduler": sched.state_dict(), "state": state, "rng": torch.get_rng_state()}, ckpt)

    def replan():
        """Time budget -> step count. Re-estimated every few steps from the average step time so far
        (the CPU may be shared, so one early probe can be far off); the cosine follows the estimate."""
        sec = state["train_seconds"] / max(1, state["step"] - state["timed_from"])
        left = m["max_minutes"] * 60 - (time.time() - t_start)
        left -= (left / (m["eval_minutes"] * 60) + 1) * state.get("eval_seconds", 0)  # evals still to come
        # The main process's estimate, on every process: each one's own would stop them at different steps.
        total = main_process_decides(acc, int(min(m["max_steps"], state["step"] + max(1, left // sec))))[0]
        if state["total_steps"] is None and acc.is_main_process:
            tqdm.write(f"[{name}] probe {sec:.2f}s/step -> ~{total} steps ({total * tokens_per_step / 1e6:.1f}M tokens)")
        state["total_steps"] = total
        state["sec_per_step"] = round(sec, 4)
        pbar.total = total
        pbar.refresh()

    t_start = time.time() - state["elapsed"]
    state.setdefault("train_seconds", 0.0)
    state.setdefault("timed_from", None)
    if state["step"] == 0:
        evaluate()
    last_ckpt = last_eval = time.time()
    pbar = tqdm(total=state["total_steps"] or m["max_steps"], initial=state["step"], desc=name,
                mininterval=1 if sys.stderr.isatty() else 30, disable=not acc.is_main_process)
    model.train()
    ema = state.get("ema")
    while state["total_steps"] is None or state["step"] < state["total_steps"]:
        step = state["step"]
        if m["max_minutes"]:
            if state["timed_from"] is None and step >= 2:  # skip the first steps (allocator warm-up)
                state["timed_from"], state["train_seconds"] = step, 0.0
            n = step - (state["timed_from"] or step)
            if n >= m["probe_steps"] - 2 and (state["total_steps"] is None or step % m["replan_every"] == 0):
                if state["total_steps"] is None and step >= m["warmup_steps"]:
                    raise RuntimeError("probe_steps must be well below warmup_steps")
                replan()
                if step >= state["total_steps"]:
                    break
        t_step = time.time()
        x = train_batch(train, step, acc.process_index, cfg["seed"], m["batch_size"], m["seq_len"]).to(acc.device)
        with acc.autocast():
            loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), m["grad_clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        lv = loss.item()
        state["train_seconds"] += time.time() - t_step
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        state["ema"] = ema
        if state["step"] % 10 == 0:
            state["train_curve"].append([state["step"], state["step"] * tokens_per_step, round(ema, 4)])
        state["elapsed"] = time.time() - t_start
        pbar.update(1)
        pbar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{state['step'] * tokens_per_step / max(state['elapsed'], 1e-9):.0f}",
                         lr=f"{sched.get_last_lr()[0]:.2e}", refresh=False)
        # Both wait for every process: all of them must reach them at the same step (training/processes.py).
        evaluate_now, checkpoint_now = main_process_decides(acc, time.time() - last_eval >= m["eval_minutes"] * 60,
                                                            time.time() - last_ckpt >= cfg["checkpoint_minutes"] * 60)
        if evaluate_now:
            evaluate()
            last_eval = time.time()
        if checkpoint_now:
            checkpoint()
            last_ckpt = time.time()
        if stop_after is not None and state["step"] >= stop_after:  # tests: simulate a kill
            checkpoint()
            pbar.close()
            return None
    pbar.close()
    evaluate()
    train_seconds = time.time() - t_start

    metrics = None
    if acc.is_main_process:
        save_hf_folder(raw, ctx.tok_dir, out_dir)
        # Final numbers come from the saved bf16 weights (what users load), run in fp32.
        saved = load_fp32(out_dir)
        final = heldout_loss(saved, eval_windows, cfg["eval"]["batch_size"])
        small = heldout_loss(saved, heldout_windows(held, cfg["eval"]["small_tokens"], cfg["eval"]["seq_len"]))
        metrics = {
            "name": f"python-{name}", "params": n_params,
            "params_non_embedding": n_params - raw.model.embed_tokens.weight.numel()
            - (0 if m["tie_embeddings"] else raw.lm_head.weight.numel()),
            "steps": state["step"], "tokens_seen": state["step"] * tokens_per_step,
            "tokens_per_step": tokens_per_step, "num_processes": acc.num_processes,
            "train_tokens_per_epoch": int(len(train)),
            "tokens_per_second": round(state["step"] * tokens_per_step / train_seconds, 1),
            "wall_seconds": round(time.time() - t_start, 1),
            "final_heldout_loss": round(final, 4),
            "final_heldout_loss_definition": f"mean nats/token, saved bf16 weights run in fp32, "
            f"{len(eval_windows)} evenly spaced windows of {cfg['eval']['seq_len']} held-out tokens",
            "small_sample_heldout_loss": round(small, 4),
            "small_sample_definition": {"tokens": cfg["eval"]["small_tokens"], "seq_len": cfg["eval"]["seq_len"]},
            "heldout_curve": state["heldout_curve"], "heldout_curve_columns": ["step", "tokens", "loss(train precision)"],
            "train_curve": state["train_curve"], "train_curve_columns": ["step", "tokens", "loss(ema 0.95)"],
            "sec_per_step": state.get("sec_per_step"),
            "resumed_from_steps": state["resumed_from"],
            "mixed_precision": cfg["mixed_precision"], "device": str(acc.device),
            "torch_threads": torch.get_num_threads(),
            "command": command, "versions": versions(), "corpus": ctx.corpus_info(),
            "config": stage_cfg,
        }
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        print(f"[{name}] done: {n_params / 1e6:.2f}M params, {metrics['tokens_seen'] / 1e6:.1f}M tokens, "
              f"heldout {final:.4f}, {train_seconds / 60:.1f} min", flush=True)
    acc.wait_for_everyone()
    return metrics


@torch.no_grad()
def stage_pair(ctx: Ctx) -> dict:
    """Greedy agreement under teacher forcing on the fixed held-out sample: how often the draft's
    argmax next token equals the target's (an upper-bound flavour of greedy acceptance rate)."""
    cfg = ctx.cfg
    _, held = ctx.streams()
    w = heldout_windows(held, cfg["eval"]["heldout_tokens"], cfg["eval"]["seq_len"])
    tgt, drf = load_fp32(ctx.out / "python-target"), load_fp32(ctx.out / "python-draft")
    agree = count = 0
    bs = cfg["eval"]["batch_size"]
    for i in range(0, len(w), bs):
        x = w[i:i + bs]
        a = tgt(input_ids=x).logits.argmax(-1)
        b = drf(input_ids=x).logits.argmax(-1)
        agree += (a == b).sum().item()
        count += a.numel()
    mt = json.loads((ctx.out / "python-target" / "metrics.json").read_text())
    md = json.loads((ctx.out / "python-draft" / "metrics.json").read_text())
    pm = {"greedy_agreement": round(agree / count, 4), "positions": count,
          "definition": "fraction of positions where argmax draft == argmax target, teacher forcing on the "
          "fixed held-out sample (fp32 from the saved bf16 weights)",
          "target_heldout_loss": mt["final_heldout_loss"], "draft_heldout_loss": md["final_heldout_loss"],
          "loss_gap": round(md["final_heldout_loss"] - mt["final_heldout_loss"], 4)}
    (ctx.out / "pair_metrics.json").write_text(json.dumps(pm, indent=1) + "\n")
    print(f"[pair] {pm}", flush=True)
    return pm


@restores_torch_threads
def pretrain(config, only: str | None = None, command: str = "", stop_after: int | None = None) -> dict:
    """Run the stages (or just `only`); returns {stage: metrics}. `stop_after` (tests) stops a model
    stage after that many steps, leaving only its checkpoint, as a kill would."""
    cfg = load_config(config)
    torch.set_num_threads(cfg["threads"])
    ctx = Ctx(cfg)
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    from accelerate import PartialState

    # Under torchrun / accelerate launch only rank 0 writes the shared files. cpu= as the stages'
    # Accelerator has it: without a GPU, PartialState() would make each process a run of its own.
    dist = PartialState(cpu=not torch.cuda.is_available())
    results = {}
    for stage in STAGES:
        if only and stage != only:
            continue
        if stage == "tokenizer":
            with dist.main_process_first():  # rank 0 trains + caches; the others then find it
                if dist.is_main_process and (only == "tokenizer" or not (ctx.tok_dir / "tokenizer.json").exists()):
                    results[stage] = stage_tokenizer(ctx)
        elif stage == "pair":
            if dist.is_main_process and all((ctx.out / f"python-{n}" / "metrics.json").exists()
                                            for n in ("target", "draft")):
                results[stage] = stage_pair(ctx)
        else:
            results[stage] = stage_model(ctx, stage, command, stop_after)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "pretrain.yaml"))
    ap.add_argument("--only", choices=STAGES, help="run one stage")
    ap.add_argument("--out", help="output folder (overrides config 'out')")
    a = ap.parse_args(argv)
    cfg = read_yaml(a.config, "pretrain config") or {}
    if a.out:
        cfg["out"] = a.out
    cmd = "python -m draftsman.training.pretrain " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    pretrain(cfg, only=a.only, command=cmd)


if __name__ == "__main__":
    main()
