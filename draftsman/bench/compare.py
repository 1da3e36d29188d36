"""`draftsman compare`: every drafter on one target, side by side, with the Hugging Face peers in
the same run. Loads the target once, times every drafter x category x temperature interleaved,
checks losslessness at T=0, runs the batch sweep, and hands the results to report.py."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from ..api import Decoder
from ..config import load_config
from .config import changes_greedy_output, drafter_label, drafter_options, is_lossy
from .memory import PeakMemory
from .peers import PeerFailed, build_peers
from .prompts_set import Prompt, answer_earlier_turns, by_category, read_prompts
from .runner import Ours, Tally, batch_sweep, first_divergence, median_interval, time_interleaved


def run_compare(cfg: dict, command: str = "draftsman compare", progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    prompts, meta = read_prompts(cfg["prompts"])
    groups = by_category(prompts, cfg["categories"], cfg["prompts_per_category"])
    if cfg["batch_category"] and cfg["batch_category"] not in groups:  # before any model loads
        raise ValueError(f"batch_category '{cfg['batch_category']}' is not among the categories run: {sorted(groups)}")
    # Every drafter's Decoder copies this config, so the sampling section reaches every cell.
    base = Decoder(load_config({"target": cfg["target"], "drafter": {"name": "none"},
                                "sampling": cfg["sampling"] or {}}))
    if base.tokenizer is None:
        raise ValueError(f"target folder '{cfg['target']['path']}' has no tokenizer; compare reads text "
                         "prompts, so it needs one")
    chosen = [p for ps in groups.values() for p in ps]
    if any(p.messages is None and p.turns is not None for p in chosen):
        if progress:
            print("answering the earlier turns of multi-turn prompts with the target (greedy) ...", file=sys.stderr)
        answer_earlier_turns(base, chosen, cfg["max_new_tokens"])
    encoded = {c: _encode(base, ps, cfg["max_new_tokens"]) for c, ps in groups.items()}

    # `none` needs no second Decoder: the base one already has it.
    ours = [Ours(drafter_label(d), base if d["name"] == "none" else base.with_drafter(drafter_options(d)),
                 cfg["min_new_tokens"], d.get("lossy_typical_acceptance")) for d in cfg["drafters"]]
    baseline = next(o.label for o in ours if o.name == "none")
    with_peers = cfg["peers"] and 0 in cfg["temperatures"] and not changes_greedy_output(cfg["sampling"])
    peers, notes = build_peers(base, cfg["drafters"], cfg["min_new_tokens"]) if with_peers else ([], [])
    if cfg["peers"] and 0 not in cfg["temperatures"]:
        notes.append("peers skipped: they run greedy and temperature 0 is not among the temperatures")
    elif cfg["peers"] and not with_peers:
        notes.append("peers skipped: they run plain greedy decoding, and the sampling section's penalties, bias, "
                     "bans or structured output change greedy output")
    if any(t > 0 for t in cfg["temperatures"]):
        if is_lossy(cfg["sampling"] or {}):
            notes.append("LOSSY: sampling.lossy_typical_acceptance is on, so at T > 0 drafts are accepted by "
                         "Medusa's typical acceptance and the outputs are not distributed as the target's own samples")
        elif any(is_lossy(d) for d in cfg["drafters"]):
            notes.append("LOSSY: at T > 0 the rows labelled (LOSSY) accept drafts by Medusa's typical acceptance; "
                         "their outputs are not distributed as the target's own samples")
    meter = PeakMemory(base.device)
    weights = sum(p.numel() * p.element_size() for p in base.target.parameters())
    elem = base.target.dtype.itemsize

    sweep_t = 0 if 0 in cfg["temperatures"] else cfg["temperatures"][0]
    sweep_rows = encoded[cfg["batch_category"]] if cfg["batch_category"] else _mixed(list(encoded.values()))
    swept = [o for o in ours if cfg["sweep_drafters"] is None or o.label in cfg["sweep_drafters"] or o.label == baseline]
    peer_settings = {p.label: p.settings for p in peers}  # now: a peer dropped later keeps its rows' settings
    bar = tqdm(total=_plan(cfg, encoded, len(ours), len(peers), len(swept)), unit="run", disable=not progress,
               dynamic_ncols=True)

    cells, peer_rows, overall = [], [], []
    for temperature in cfg["temperatures"]:
        together = {o.label: Tally() for o in ours}  # every category at once, as Spec-Bench's "overall"
        for index, (category, ids) in enumerate(encoded.items()):
            bar.set_description(f"T={temperature:g} {category}")

            def drop(e: PeerFailed, category=category, later=list(encoded.values())[index + 1:]):
                # the others' runs go on; none is timed again
                peers.remove(e.peer)
                notes.append(f"{e} (on a {category} prompt): dropped from then on; its rows before are kept")
                bar.total -= sum(2 + cfg["repeats"] * len(rows) for rows in later)  # its calls _plan counted
                bar.refresh()

            tallies = time_interleaved(ours + (peers if temperature == 0 else []), ids,
                                       max_new_tokens=cfg["max_new_tokens"], temperature=temperature,
                                       repeats=cfg["repeats"], seed=cfg["seed"], tick=bar.update, memory=meter,
                                       on_peer_failed=drop)
            plain = tallies[baseline]
            for o in ours:
                cells.append(_cell(o, tallies[o.label], plain, category, temperature, groups[category], ids,
                                   base.target, weights + o.extra_parameters * elem))
                together[o.label].absorb(tallies[o.label])
            for p in peers if temperature == 0 else []:
                peer_rows.append(_peer_row(p, tallies, plain, ours, category, groups[category], ids, base.target,
                                           weights + p.extra_parameters * elem))
        overall += [_overall(o, together[o.label], together[baseline], temperature, sum(map(len, groups.values())))
                    for o in ours]

    bar.set_description(f"batch sweep T={sweep_t:g}")
    sweep = batch_sweep(swept, sweep_rows, cfg["batch_sizes"], max_new_tokens=cfg["max_new_tokens"],
                        temperature=sweep_t, repeats=cfg["sweep_repeats"], seed=cfg["seed"], baseline=baseline,
                        tick=bar.update)
    bar.close()
    points = []
    for b, tallies in sweep.items():
        for o in swept:
            t, paired_base = tallies[o.label]
            pairs = t.speedups(paired_base)
            low, high = median_interval(pairs) or (None, None)
            points.append({"drafter": o.label, "batch_size": b, "tokens_per_s": t.tokens_per_s,
                           "speedup": statistics.median(pairs), "speedup_low": low, "speedup_high": high,
                           "pair_speedups": pairs, "tau": t.tau, "new_tokens": t.new_tokens})
    return {
        "command": command,
        "config": cfg,
        "environment": environment(base.device),
        "memory_method": meter.method,
        "prompts": {"file": str(cfg["prompts"]), "meta": meta, "counts": {c: len(ps) for c, ps in groups.items()}},
        "baseline": baseline,
        "cells": cells,
        "overall": overall,
        "peers": peer_rows,
        "peer_settings": peer_settings,
        "notes": notes,
        "batch_sweep": {"temperature": sweep_t, "rows": cfg["batch_category"] or "mixed", "points": points},
    }


def _encode(decoder: Decoder, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    unanswered = [p.id for p in prompts if p.messages is None and p.turns is not None]
    if unanswered:  # its text is empty: it would time a prompt of nothing
        raise RuntimeError(f"prompts {unanswered} need answer_earlier_turns before they are encoded")
    ids = [list(p.input_ids) if p.input_ids is not None
           else decoder.encode_chat(p.messages, tools=p.tools)[0] if p.messages is not None
           else decoder.encode([p.text])[0] for p in prompts]
    room = decoder.engine.max_context
    for p, row in zip(prompts, ids):
        if len(row) + max_new_tokens > room:
            # max_new_tokens is >= 1: lowering it helps only where the prompt leaves room for a token
            fix = (f"lower max_new_tokens to {room - len(row)} or less, or drop the prompt" if len(row) < room
                   else "the prompt alone fills it: shorten or drop the prompt")
            raise ValueError(f"prompt '{p.id}' has {len(row)} tokens; with max_new_tokens {max_new_tokens} it "
                             f"runs past the target's context of {room}: {fix}")
    return ids


def _mixed(groups: list[list[list[int]]]) -> list[list[int]]:
    """Round-robin over the categories: a batch of b rows mixes them."""
    out = []
    for i in range(max(len(g) for g in groups)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def _plan(cfg: dict, encoded: dict, n_ours: int, n_peers: int, n_swept: int) -> int:
    """Calls the run will make, for the progress bar."""
    total = 0
    for temperature in cfg["temperatures"]:
        n = n_ours + (n_peers if temperature == 0 else 0)
        for ids in encoded.values():
            total += n * (2 + cfg["repeats"] * len(ids))  # warm-up + timed + memory
    paired_runs = 2 * (n_swept - 1) if n_swept > 1 else 1  # each contender beside its own baseline run
    return total + len(cfg["batch_sizes"]) * (n_swept + cfg["sweep_repeats"] * paired_runs)


def _divergences(target, prompts: list[Prompt], ids, expected: list[list[int]], got: list[list[int]]) -> list[dict]:
    return [{"prompt": p.id, **first_divergence(target, row, e, g)}
            for p, row, e, g in zip(prompts, ids, expected, got) if e != g]


def _cell(o: Ours, t: Tally, plain: Tally, category: str, temperature: float, prompts, ids, target,
          static_bytes: int) -> dict:
    greedy = temperature == 0
    div = _divergences(target, prompts, ids, plain.outputs, t.outputs) if greedy else []
    return {
        "drafter": o.label, "name": o.name, "category": category, "temperature": temperature,
        "lossy": t.lossy, "prompts": len(prompts), "repeats": len(t.rep_tokens),
        "tokens_per_s": t.tokens_per_s, "tokens_per_s_repeats": t.rep_tokens_per_s,
        "speedup": statistics.median(t.speedups(plain)), "speedup_repeats": t.speedups(plain),
        "tau": t.tau, "acceptance": t.acceptance, "rounds": t.rounds, "new_tokens": t.new_tokens,
        **t.time_split(),
        "peak_memory_mb": _mb(static_bytes, t.peak_bytes), "working_memory_mb": _mb(0, t.peak_bytes),
        "extra_parameters": o.extra_parameters,
        "mismatches": len(div) if greedy else None, "divergences": div,
    }


def _overall(o: Ours, t: Tally, plain: Tally, temperature: float, prompts: int) -> dict:
    """One drafter over every category at once: tokens over seconds summed across categories, repeat
    by repeat (the speedup is the median of those per-repeat ratios, as in a cell)."""
    return {"drafter": o.label, "temperature": temperature, "prompts": prompts, "lossy": t.lossy,
            "tokens_per_s": t.tokens_per_s, "speedup": statistics.median(t.speedups(plain)),
            "speedup_repeats": t.speedups(plain), "tau": t.tau, "acceptance": t.acceptance,
            "new_tokens": t.new_tokens, "row_rounds": t.row_rounds}


def _peer_row(p, tallies: dict, plain: Tally, ours: list, category: str, prompts, ids, target,
              static_bytes: int) -> dict:
    t = tallies[p.label]
    plain_hf = tallies.get("hf_generate")  # None once hf_generate failed and was dropped
    div = _divergences(target, prompts, ids, plain.outputs, t.outputs)
    counterpart_name = {"hf_generate": "none", "hf_assisted": "draft_model", "hf_prompt_lookup": "ngram",
                        "hf_universal_assisted": "cross_tokenizer", "hf_early_exit": "layer_skip"}[p.label]
    # Every drafter of ours with the same name (say draft_model fixed and adaptive): the first is
    # `counterpart` (kept for scripts that read it), all of them are in `counterparts`.
    mine_all = [o.label for o in ours if o.name == counterpart_name]
    mine = mine_all[0] if mine_all else None
    return {
        "peer": p.label, "category": category, "temperature": 0, "prompts": len(prompts),
        "tokens_per_s": t.tokens_per_s, "speedup": statistics.median(t.speedups(plain)),
        "speedup_vs_hf_generate": statistics.median(t.speedups(plain_hf)) if plain_hf else None,
        "same_as_ours": len(prompts) - len(div), "divergences": div,
        "counterpart": mine,
        "counterpart_over_peer": statistics.median(tallies[mine].speedups(t)) if mine else None,
        "counterparts": {label: statistics.median(tallies[label].speedups(t)) for label in mine_all},
        "peak_memory_mb": _mb(static_bytes, t.peak_bytes), "extra_parameters": p.extra_parameters,
    }


def _mb(static_bytes: int, peak: int | None) -> float | None:
    return None if peak is None else (static_bytes + max(peak, 0)) / 2**20


def environment(device: torch.device) -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "draftsman": __version__, "git_commit": _git_commit(),
    }
    return env


def _git_commit() -> str | None:
    """The checkout's commit (editable installs), None elsewhere; read-only."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
