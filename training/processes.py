"""The Accelerator every trainer runs under, and the decisions that every process of a
multi-process run (torchrun, accelerate launch) takes together.

The processes train in lockstep: each step's backward all-reduces their gradients. A decision
read off a process's own clock (stop at `max_minutes`, evaluate or checkpoint every N minutes, how
many steps the time budget allows, the cosine's learning rate) can come out differently on two
processes that read it a millisecond apart. The one that stops, or waits at a barrier, leaves the
others blocked in the next all-reduce until the collective times out, and the run ends without
its final save; one that takes another learning rate drifts from the others' weights (gradients
are synced, weights are not). So the main process decides and the others take its answer.
"""
from __future__ import annotations

import torch


def main_process_decides(acc, *values):
    """The main process's `values` (bools, whole numbers, seconds), on every process of `acc`'s run."""
    if acc.num_processes == 1:
        return values
    from accelerate.utils import broadcast
    shared = broadcast(torch.tensor([float(v) for v in values], dtype=torch.float64, device=acc.device),
                       from_process=0)
    return tuple(type(v)(x) for v, x in zip(values, shared.tolist()))


def step_report(acc, loss: torch.Tensor, accuracy: torch.Tensor) -> tuple[float, list[float]]:
    """A step's loss and accuracies (tensors on the device) as numbers for the progress bar and the
    curve, each the mean over the processes: one process's own come from its windows alone, and
    under assistant_only_loss its loss is its share of the step's (training/heads.py
    step_learned_counts), which only the mean makes the step's loss. One host sync a step, and
    under several processes one small all-reduce before it."""
    values = torch.cat([loss.detach().reshape(1), accuracy.reshape(-1).to(loss.device)]).float()
    if acc.num_processes > 1:
        values = acc.reduce(values, "mean")
    values = values.tolist()
    return values[0], values[1:]


def resolve_mixed_precision(mode: str) -> str:
    """Accelerate's mixed_precision: "no", "bf16", or "auto" (bf16 where this machine runs it
    natively, else "no"). bf16 autocast on a CPU without native bf16 (AVX2 only) is emulated: a
    heads training step took 42 s there against 1.5 s in float32, so asking for it warns."""
    import warnings

    from ..models import native_bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if mode == "auto":
        return "bf16" if native_bfloat16(device) else "no"
    if mode == "bf16" and not native_bfloat16(device):
        warnings.warn(f"mixed_precision bf16 on a {device} without native bf16 math: training runs many times "
                      "slower than in float32 here; set mixed_precision: auto or no", stacklevel=2)
    return mode


_MADE_HERE = {"mixed_precision": None}  # the mode of the last Accelerator accelerator() made in this process


def accelerator(mixed_precision: str):
    """Accelerate's Accelerator for a trainer: on the GPU where there is one (each process its own
    under a launcher), else on the CPU, where several processes sync through gloo.

    Accelerate keeps one mixed-precision setting per Python process and refuses another: a second
    run in a notebook with another mixed_precision would fail. Where that setting is the one this
    function set last, a trainer's, it is dropped for the new one (the process group stays); where
    someone else's Accelerator set it, theirs is left alone and the run is refused, naming both."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    mode = resolve_mixed_precision(mixed_precision)
    held = AcceleratorState._shared_state.get("_mixed_precision")
    if held is not None and held != mode:
        if held != _MADE_HERE["mixed_precision"]:
            asked = mixed_precision if mode == mixed_precision else f"{mixed_precision} ({mode} here)"
            raise ValueError(f"mixed_precision {asked}: this Python process already has an Accelerator with "
                             f"mixed_precision {held!r}, and Accelerate allows one setting per process; set "
                             f"mixed_precision: {held} in the config, or train in a new process")
        AcceleratorState._reset_state()
    acc = Accelerator(mixed_precision=mode, cpu=not torch.cuda.is_available())
    _MADE_HERE["mixed_precision"] = mode
    return acc
