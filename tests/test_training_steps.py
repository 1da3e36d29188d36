"""Optimizer steps of the trainers (`draftsman train <heads kind>` and `train pard`): gradient
accumulation gives the gradient of one batch of the micro-batches' total size, and a run with it
ends where the run with that batch ends, in one process or two (torchrun, where the main
process's clock decides for both); grad_clip bounds each step; eval_every records held-out
agreement as training goes; PARD's mixed precision; a run says what a step reads; token caches
are written whole or not at all; bad values are named; older checkpoints still resume."""
import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from draftsman.training import heads as heads_training, pard as pard_training, pretrain as pretrain_stages, vocab
from draftsman.training.heads import accumulated_backward, micro_batches
from draftsman.training.heads_config import check_values

from test_training_documents import config, rows, write


@pytest.mark.parametrize("count", [2, 4])
def test_accumulated_micro_batches_give_the_whole_batchs_gradient(count):
    """The mean of the micro-batches' losses, backward one at a time, is the whole batch's gradient;
    each micro-batch gets its rows of the learned mask, and all but the last run unsynced."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    rows = torch.randn(8, 9)  # inputs (6 columns) and targets (3)
    learned = torch.rand(8, 3) > 0.3
    masks_seen, unsynced = [], []

    def loss_of(batch, mask):
        masks_seen.append(mask)
        loss = ((model(batch[:, :6]) - batch[:, 6:]) ** 2).mean()
        return loss, [loss.item()]

    whole_loss, _ = loss_of(rows, None)
    whole_loss.backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    @contextlib.contextmanager
    def no_sync():
        unsynced.append(True)
        yield

    loss, accuracy = accumulated_backward(micro_batches(rows, learned, count), loss_of, torch.Tensor.backward,
                                          no_sync, count)
    loss, accuracy = loss.item(), accuracy.tolist()  # (tensors: the trainers read them once a step)
    assert loss == pytest.approx(whole_loss.item(), rel=1e-5) and accuracy == [pytest.approx(loss, rel=1e-6)]
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), whole))
    assert torch.equal(torch.cat(masks_seen[1:]), learned) and len(unsynced) == count - 1


def test_a_steps_learned_counts_divide_as_each_losss_own_count_does():
    """One micro-batch of one process: dividing by step_learned_counts is dividing by the positions
    each loss reads (columns s.. of the mask, for every s); none learned gives 0, not NaN. Two
    micro-batches each divide by half of the step's count (their mean is the step's mean)."""
    learned = torch.rand(4, 9, generator=torch.Generator().manual_seed(0)) < 0.4
    summed = torch.tensor(3.0)
    counts = heads_training.step_learned_counts(learned, 1)
    assert heads_training.step_learned_counts(None, 1) is None
    for s in range(9):
        keep = learned[:, s:]
        own = heads_training.masked_mean(summed, keep)
        assert heads_training.masked_mean(summed, keep, counts).item() == pytest.approx(own.item(), rel=1e-6)
        assert own.item() == pytest.approx(3.0 / max(1, int(keep.sum())), rel=1e-6)
    nothing = torch.zeros(2, 9, dtype=torch.bool)
    assert heads_training.masked_mean(torch.tensor(0.0), nothing, heads_training.step_learned_counts(nothing, 2)) == 0
    halves = heads_training.step_learned_counts(learned, 2)
    assert torch.allclose(halves * 2, counts)


def _heads_config(tiny_models, tiny_corpus, work, out, **keys):
    return {"target": str(tiny_models["llama"][0]), "out": str(work / out), "work_dir": str(work / "w"),
            "corpus_root": str(tiny_corpus), "threads": 1, "mixed_precision": "no", "num_heads": 2, "seq_len": 32,
            "batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "max_steps": 3, "eval_tokens": 64, "tree_budget": 2,
            **keys}


def _assert_same_weights(a_folder, b_folder):
    """Equal up to float sums: within 1e-5, or (heads saved in bfloat16) one bfloat16 step apart
    where a float32 sum fell on the other side of a rounding boundary, for a few elements only.
    A wrong step moves most elements by about lr (3e-3)."""
    a, b = load_file(a_folder / "model.safetensors"), load_file(b_folder / "model.safetensors")
    assert a.keys() == b.keys()
    off = total = 0
    for k in a:
        x, y = a[k].double(), b[k].double()
        apart = (x - y).abs() > 1e-5
        assert ((x - y).abs() <= x.abs() * 2.0 ** -7 + 1e-5).all(), k
        off, total = off + int(apart.sum()), total + x.numel()
    assert off <= total // 1000, f"{off} of {total} elements differ"


def _pard_config(tiny_models, tiny_corpus, work, out, **keys):
    return {"draft": str(tiny_models["llama"][1]), "out": str(work / out), "k": 3, "threads": 1,
            "work_dir": str(work / "w"), "corpus_root": str(tiny_corpus), "seq_len": 32, "batch_size": 4,
            "lr": 3e-3, "warmup_steps": 1, "max_steps": 3, "eval_tokens": 64, **keys}


@pytest.fixture
def trained_weights(monkeypatch) -> dict:
    """{out folder name: the heads' float32 weights as trained}, kept as each run saves them (the
    folder holds them in bfloat16, whose rounding would hide or invent differences this small)."""
    weights, save = {}, heads_training.evaluate_and_save

    def kept_and_saved(cfg, heads, *args, **kwargs):
        weights[Path(cfg["out"]).name] = {k: v.detach().clone() for k, v in heads.state_dict().items()}
        return save(cfg, heads, *args, **kwargs)

    monkeypatch.setattr(heads_training, "evaluate_and_save", kept_and_saved)
    return weights


def _reports(monkeypatch, trainer) -> list:
    """[loss, *accuracies] as `trainer` reports each step (its record_step), in the order taken."""
    reports, record = [], trainer.record_step
    monkeypatch.setattr(trainer, "record_step", lambda state, t, loss, accuracy, *rest:
                        reports.append([loss, *accuracy]) or record(state, t, loss, accuracy, *rest))
    return reports


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def test_heads_trained_with_accumulation_match_the_whole_batch(tiny_models, tiny_corpus, tmp_path, capsys,
                                                               trained_weights):
    """batch 4 in one step, and batch 2 twice per step: the same windows, the same weights after 3
    steps (up to float sums; a step per micro-batch or other windows move them by about lr). The
    run says what a step reads."""
    whole = heads_training.train(_heads_config(tiny_models, tiny_corpus, tmp_path, "whole"))
    accumulated = heads_training.train(_heads_config(tiny_models, tiny_corpus, tmp_path, "accumulated",
                                                     batch_size=2, grad_accum_steps=2))
    assert ("[medusa] each step: 2 window(s) x 2 micro-batch(es) x 1 process(es) = 4 windows of 32 tokens; "
            "the target in torch.float32") in capsys.readouterr().out
    assert accumulated["tokens_seen"] == whole["tokens_seen"] == 3 * 4 * 32
    assert _max_difference(trained_weights["whole"], trained_weights["accumulated"]) < 1e-5


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])  # the three losses
def test_replies_only_accumulation_matches_the_whole_batch(kind, chat_target, tmp_path, trained_weights,
                                                          monkeypatch):
    """assistant_only_loss: each micro-batch learns its own number of positions (its windows' reply
    tokens), so the mean of the micro-batches' means would weigh a position of a short reply above
    one of a long reply. A step is the mean over all the positions it learns: batch 2 twice per
    step ends with the weights of batch 4 once, and reports the same loss and accuracies at each
    step (Adam would hide a loss scaled by a constant; the report does not)."""
    folder = chat_target[0]
    path = write(tmp_path / "chat.jsonl", rows())
    reports = _reports(monkeypatch, heads_training)
    keys = {"kind": kind, "assistant_only_loss": True, "max_steps": 3, "ttt_steps": 2, "feature_noise": 0.0}
    heads_training.train(config(folder, tmp_path, path, out=str(tmp_path / "whole"), **keys))
    heads_training.train(config(folder, tmp_path, path, out=str(tmp_path / "accumulated"), batch_size=2,
                                grad_accum_steps=2, **keys))
    assert _max_difference(trained_weights["whole"], trained_weights["accumulated"]) < 1e-5
    assert len(reports) == 6
    for whole, accumulated in zip(reports[:3], reports[3:]):
        assert accumulated == pytest.approx(whole, rel=1e-5, abs=1e-6)


def test_grad_clip_bounds_each_step(tiny_models, tiny_corpus, tmp_path, trained_weights):
    """With the gradient clipped to a norm far below Adam's epsilon the heads barely move from their
    initial weights (max_steps 0); unclipped, the same 3 steps move them by about lr."""
    for out, keys in [("init", {"max_steps": 0}), ("clipped", {"grad_clip": 1e-12}), ("free", {})]:
        heads_training.train(_heads_config(tiny_models, tiny_corpus, tmp_path, out, **keys))
    lr = 3e-3
    assert _max_difference(trained_weights["init"], trained_weights["clipped"]) < 0.01 * lr
    assert _max_difference(trained_weights["init"], trained_weights["free"]) > 0.5 * lr


def test_pard_trained_with_accumulation_matches_the_whole_batch(tiny_models, tiny_corpus, tmp_path, monkeypatch):
    """As for heads, read in float32 as trained (the folder is written in bfloat16); grad_clip too."""
    weights, save = {}, pard_training.save_hf_folder

    def kept_and_saved(model, tok_dir, out_dir):
        weights[out_dir.name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        save(model, tok_dir, out_dir)

    monkeypatch.setattr(pard_training, "save_hf_folder", kept_and_saved)

    def train(out, **keys):
        return pard_training.train(_pard_config(tiny_models, tiny_corpus, tmp_path, out, **keys))

    whole, accumulated = train("whole"), train("accumulated", batch_size=2, grad_accum_steps=2)
    for out, keys in [("init", {"max_steps": 0}), ("clipped", {"grad_clip": 1e-12})]:
        train(out, **keys)
    assert accumulated["tokens_seen"] == whole["tokens_seen"] == 3 * 4 * 32
    assert _max_difference(weights["whole"], weights["accumulated"]) < 1e-5
    lr = 3e-3
    assert _max_difference(weights["init"], weights["clipped"]) < 0.01 * lr
    assert _max_difference(weights["init"], weights["whole"]) > 0.5 * lr


def test_pard_mixed_precision_runs_the_model_under_autocast(tiny_models, tiny_corpus, tmp_path, monkeypatch):
    """mixed_precision bf16 (for GPUs): the training and evaluation forwards run under autocast;
    "no" (the default, as the bundled model was trained) keeps them in float32. Accelerate keeps
    one setting per Python process and refuses another; runs one after another in one process (a
    notebook) each get their own."""
    seen, logits_of = [], pard_training.parallel_logits

    def recorded(model, x, *args):
        device = x.device.type
        seen.append(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32)
        return logits_of(model, x, *args)

    monkeypatch.setattr(pard_training, "parallel_logits", recorded)
    for i, mixed_precision in enumerate(["no", "bf16", "no"]):
        pard_training.train(_pard_config(tiny_models, tiny_corpus, tmp_path, f"pard{i}", max_steps=1, eval_tokens=32,
                                         mixed_precision=mixed_precision))
    f32, bf16 = torch.float32, torch.bfloat16
    assert seen == [f32, f32, bf16, bf16, f32, f32]  # each run: one step, one held-out batch


def test_another_accelerators_mixed_precision_is_named_not_replaced():
    """An Accelerator the user made (not a trainer) keeps its setting; a trainer asking for another
    is refused with both named and the fix."""
    from accelerate import Accelerator

    from draftsman.training.processes import accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        theirs = Accelerator(mixed_precision="bf16", cpu=True)
        with pytest.raises(ValueError, match="already has an Accelerator with mixed_precision 'bf16'.*"
                                             "set mixed_precision: bf16 in the config, or train in a new process"):
            accelerator("no")
        assert theirs.mixed_precision == "bf16"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("keys,message", [
    ({"grad_accum_steps": 0}, "grad_accum_steps must be a whole number >= 1"),
    ({"grad_accum_steps": 1.5}, "grad_accum_steps must be a whole number >= 1"),
    ({"grad_accum_steps": True}, "grad_accum_steps must be a whole number >= 1"),
    ({"grad_clip": 0}, r"grad_clip must be a gradient norm > 0 \(e.g. 0.5\) or null"),
    ({"grad_clip": "big"}, r"grad_clip must be a gradient norm > 0"),
    ({"eval_every": -1}, r"eval_every must be a whole number of steps >= 0"),
    ({"eval_every": 2.5}, r"eval_every must be a whole number of steps >= 0"),
    # Every other value by its type and range: each of these failed deep in torch, or trained nothing,
    # after the target had loaded and the corpus been read.
    ({"lr": "abc"}, "lr must be a finite number, got 'abc'"),
    ({"lr": float("nan")}, "lr must be a finite number, got nan"),
    ({"lr": 0.0}, "lr must be greater than 0, got 0.0"),
    ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
    ({"batch_size": True}, "batch_size must be a whole number, got True"),
    ({"seq_len": 8.5}, "seq_len must be a whole number, got 8.5"),
    ({"threads": 0}, "threads must be at least 1"),
    ({"max_steps": -1}, "max_steps must be at least 0, got -1"),
    ({"warmup_steps": -5}, "warmup_steps must be at least 0"),
    ({"checkpoint_minutes": -1}, "checkpoint_minutes must be at least 0"),
    ({"max_minutes": 0}, "max_minutes must be greater than 0, got 0"),
    ({"eval_tokens": 0}, "eval_tokens must be at least 1"),
    ({"seed": "x"}, "seed must be a whole number, got 'x'"),
    ({"mixed_precision": "fp16"}, r"mixed_precision must be one of \['no', 'bf16', 'auto'\], got 'fp16'"),
    ({"out": 5}, "out must be a folder or file path, got 5"),
    ({"batch_size": None}, "batch_size cannot be null; its default is 8"),  # `--set batch_size=`
])
@pytest.mark.parametrize("trainer", ["heads", "pard"])
def test_bad_step_keys_are_named(tiny_models, keys, message, trainer):
    if trainer == "heads":
        config, load = {"target": str(tiny_models["llama"][0]), "out": "x"}, heads_training.load_config
    else:
        config, load = {"draft": str(tiny_models["llama"][1]), "out": "x"}, pard_training.load_config
    with pytest.raises(ValueError, match=f"{trainer} training config: {message}"):
        load({**config, **keys})



@pytest.mark.parametrize("keys,message", [
    ({"num_heads": 0}, "num_heads must be at least 1"),
    ({"share_lm_head": "yes"}, "share_lm_head must be true or false, got 'yes'"),
    ({"aux_layers": 3}, "aux_layers must be a list, got 3"),
    ({"draft_vocab": 0}, "draft_vocab must be at least 1"),
    ({"min_lr_ratio": 2}, r"min_lr_ratio must be in \[0, 1\]"),
    ({"loss_decay": 0}, "loss_decay must be greater than 0"),
    ({"feature_noise": -0.1}, "feature_noise must be at least 0"),
])
def test_bad_heads_values_are_named(tiny_models, keys, message):
    with pytest.raises(ValueError, match=f"heads training config: {message}"):
        heads_training.load_config({"target": str(tiny_models["llama"][0]), "out": "x", **keys})
    # every bundled config passes as it is
    for name in ("medusa", "eagle", "eagle3", "eagle3-continue", "mtp", "mlp_speculator"):
        raw = yaml.safe_load((Path(__file__).parents[1] / "training" / "configs" / f"{name}.yaml").read_text())
        check_values({**heads_training.DEFAULTS, **raw}, heads_training.DEFAULTS, "bundled")

@pytest.mark.parametrize("trainer", ["heads", "pard"])
def test_a_checkpoint_from_before_the_step_keys_resumes(trainer, tmp_path):
    """Its config has none of the later keys (grad_accum_steps, grad_clip, eval_every; heads:
    target_dtype; PARD: mixed_precision): it trained with the values those runs had, so a run of
    the same config resumes from it; one that changes them starts afresh."""
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(module.parameters())
    added = ["grad_accum_steps", "grad_clip", "eval_every"]
    if trainer == "heads":
        cfg, later, key = dict(heads_training.DEFAULTS, target="t", out="o"), heads_training.LATER_KEYS, "heads"
        added, changes = added + ["target_dtype"], ({"grad_accum_steps": 2}, {"target_dtype": "bfloat16"})
    else:
        cfg, later, key = dict(pard_training.DEFAULTS, draft="d", out="o"), pard_training.LATER_KEYS, "model"
        added, changes = added + ["mixed_precision"], ({"grad_accum_steps": 2}, {"mixed_precision": "bf16"})
    older = {k: v for k, v in cfg.items() if k not in added}
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"config": older, key: module.state_dict(), "optimizer": opt.state_dict(),
                "state": {"step": 7, "elapsed": 1.0, "curve": []}}, ckpt)
    said = []
    assert heads_training.resumed_state(ckpt, cfg, module, key, opt, said.append, later)["step"] == 7 and said == [7]
    for change in changes:
        assert heads_training.resumed_state(ckpt, {**cfg, **change}, module, key, opt, said.append, later)["step"] == 0


def test_a_checkpoint_of_another_config_is_kept_aside_and_the_change_named(tmp_path, capsys):
    """A changed config started over in silence, and its first save overwrote the old checkpoint (hours
    of training); keys that only watch, save or evaluate a run (and, at a constant learning rate, its
    length) now resume it. A damaged checkpoint was a traceback, or "invalid literal for int()"."""
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(module.parameters())
    cfg = dict(heads_training.DEFAULTS, target="t", out="o")
    ckpt = tmp_path / "ckpt.pt"

    def save(config):
        torch.save({"config": config, "heads": module.state_dict(), "optimizer": opt.state_dict(),
                    "state": {"step": 7, "elapsed": 1.0, "curve": []}}, ckpt)

    def resumed(config, main=True):
        return heads_training.resumed_state(ckpt, config, module, "heads", opt, lambda step: None, main=main)["step"]

    save(cfg)
    assert resumed({**cfg, "threads": 4, "eval_every": 5, "checkpoint_minutes": 1.0, "max_steps": 9000}) == 7
    cosine = {**cfg, "lr_schedule": "cosine"}
    save(cosine)
    assert resumed({**cosine, "max_steps": 9000}) == 0  # the cosine's remaining steps would change
    capsys.readouterr()
    save(cfg)
    assert resumed({**cfg, "lr": 0.5}, main=False) == 0 and ckpt.is_file()  # only the main process moves it
    assert resumed({**cfg, "lr": 0.5}) == 0 and not ckpt.exists()
    kept = tmp_path / "ckpt.step7.other-config.pt"
    assert torch.load(kept, weights_only=False)["config"] == cfg
    err = capsys.readouterr().err
    assert "another config (lr: 0.001 -> 0.5), so this run starts at step 0" in err and str(kept) in err
    for damage in (b"garbage\n", kept.read_bytes()[:200]):
        ckpt.write_bytes(damage)
        with pytest.raises(ValueError, match=f"the checkpoint '{ckpt}' cannot be read .*Delete it to start"):
            resumed(cfg)
    one, two = (heads_training.checkpoint_path({"out": str(tmp_path / d / "heads"), "work_dir": "w"}, "heads")
                for d in ("a", "b"))
    assert one != two and one.name.startswith("ckpt-heads-heads-")


def test_warmup_steps_0_is_no_warmup():
    """The config check allows 0; the first step divided by it (ZeroDivisionError, heads and PARD)."""
    for schedule in ("constant", "cosine"):
        cfg = dict(heads_training.DEFAULTS, warmup_steps=0, lr_schedule=schedule, min_lr_ratio=0.1, max_steps=10)
        assert heads_training.learning_rate_factor(cfg, 0, 0.0) == 1.0
    assert heads_training.warmup_factor(0, 0) == 1.0 and heads_training.warmup_factor(1, 4) == 0.5


def two_processes_with_a_fast_clock_on_one(module: str, *args, env=None) -> subprocess.CompletedProcess:
    """torchrun, 2 processes on the CPU: module.main(args), process 1's clock 100000x fast."""
    launch = Path(__file__).with_name("fast_clock_launch.py")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(launch), module, *map(str, args)],  # a hang, where a process waits alone: 120 s
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


# The feature-head loss, the training-time test (on conversations, replies only), and PARD's own trainer.
@pytest.mark.parametrize("kind", ["mtp", "eagle3", "pard"])
def test_two_processes_take_one_processs_step_on_both_draws(kind, tiny_models, tiny_corpus, tmp_path, monkeypatch,
                                                            request):
    """Several processes (torchrun, gloo on CPU; accelerate's multi-GPU path) each draw their own
    windows and average their gradients: 2 processes x 2 micro-batches of 1 window end with the
    weights of one process that takes both processes' windows as one batch of 4. A process that
    drew its peer's windows, or gradients left unsynced, would not (each moves the weights ~lr).

    And the main process's clock decides for all (training/processes.py). Process 1's runs 100000
    times fast: by its own, max_minutes would stop it at once, leaving process 0 blocked in the
    gradient all-reduce (the run fails, or hangs until the collective times out, nothing saved),
    and the heads' cosine, which follows the clock, would give it another learning rate at each
    step, so that the processes' weights drift apart.

    EAGLE-3 learns the replies only (assistant_only_loss): each process divides by its share of the
    learned positions of both processes' windows, which it learns by summing their counts. Both
    processes report each step's loss and accuracies as the one process does: the mean over the
    processes."""
    keys = {"max_minutes": 0.2}  # process 0's clock: far from it in 3 steps
    if kind == "pard":
        trainer, one = pard_training, _pard_config(tiny_models, tiny_corpus, tmp_path, "one", **keys)
        args = ["--config"]
    elif kind == "eagle3":
        one = config(request.getfixturevalue("chat_target")[0], tmp_path, write(tmp_path / "chat.jsonl", rows()),
                     out=str(tmp_path / "one"), kind=kind, ttt_steps=2, lr_schedule="cosine", max_steps=3,
                     assistant_only_loss=True, **keys)
        trainer, args = heads_training, [kind, "--config"]
    else:
        one = _heads_config(tiny_models, tiny_corpus, tmp_path, "one", kind=kind, ttt_steps=2, lr_schedule="cosine",
                            **keys)
        trainer, args = heads_training, [kind, "--config"]
    draw = trainer.train_batch

    def both_processes(stream, step, rank, seed, batch, seq_len):
        return torch.cat([draw(stream, step, r, seed, batch // 2, seq_len) for r in (0, 1)])

    monkeypatch.setattr(trainer, "train_batch", both_processes)
    reports = _reports(monkeypatch, trainer)
    # Both on the CPU, also on a machine with one GPU (two processes cannot share it).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    single = trainer.train(one)  # first: it writes the token caches both processes read
    two = {**one, "out": str(tmp_path / "two"), "batch_size": 1, "grad_accum_steps": 2}
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(two))
    run = two_processes_with_a_fast_clock_on_one(trainer.__name__, *args, tmp_path / "two.yaml",
                                                 env={"RECORD_STEPS": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    reported = json.loads(run.stdout.strip().splitlines()[-1])
    assert reported["tokens_seen"] == single["tokens_seen"] == 3 * 4 * 32
    assert "each step: 1 window(s) x 2 micro-batch(es) x 2 process(es) = 4 windows of 32 tokens" in run.stdout
    _assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert len(reports) == 3
    for rank in (0, 1):
        reported_there = json.loads((tmp_path / f"reports-{rank}.json").read_text())
        assert sum(reported_there, []) == pytest.approx(sum(reports, []), rel=1e-5, abs=1e-6)
    if trainer is heads_training:
        factors = [json.loads((tmp_path / f"lr-{rank}.json").read_text()) for rank in (0, 1)]
        assert len(factors[0]) == 3 and factors[0] == factors[1]


@pytest.mark.parametrize("kind", ["medusa", "mtp", "eagle3"])  # the three evaluators
def test_eval_every_records_the_heldout_agreement_during_training(kind, tiny_models, tiny_corpus, tmp_path):
    """eval_every 2 in 4 steps: checks at steps 2 and 4, on the final evaluation's windows, so the
    check at the last step is the final top-1 agreement."""
    metrics = heads_training.train(_heads_config(tiny_models, tiny_corpus, tmp_path, "heads", kind=kind,
                                                 max_steps=4, eval_every=2, ttt_steps=2))
    checks = metrics["heldout_during_training"]
    final = [round(a, 4) for a in metrics["heldout_agreement"]["top1"]]
    assert [step for step, _ in checks] == [2, 4] and checks[-1][1] == final
    assert len(checks[0][1]) == len(final) and all(0 <= a <= 1 for a in checks[0][1])


def test_pard_eval_every_records_the_heldout_accuracy_during_training(tiny_models, tiny_corpus, tmp_path):
    metrics = pard_training.train(_pard_config(tiny_models, tiny_corpus, tmp_path, "pard", max_steps=4,
                                               eval_tokens=256, eval_every=2))
    checks = metrics["heldout_during_training"]
    final = [round(a, 4) for a in metrics["heldout_accuracy_by_depth"]]
    assert [step for step, _ in checks] == [2, 4] and checks[-1][1] == final and len(checks[0][1]) == 3


def test_a_token_cache_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Written through this process's own temporary file (several processes may write one cache
    at once), which an interrupted write removes, leaving the cache as it was."""
    import numpy as np

    from draftsman.training import pretrain

    cache = tmp_path / "heads-train.npy"
    pretrain.atomic_np_save(cache, np.arange(3))

    def interrupted(file, array):
        Path(file).write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain.np, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pretrain.atomic_np_save(cache, np.arange(5))
    assert np.load(cache).tolist() == [0, 1, 2] and list(tmp_path.iterdir()) == [cache]


def test_a_token_cache_belongs_to_one_corpus_and_one_tokenizer(tiny_models, tiny_corpus, tmp_path):
    """The corpus cache was keyed by the target's folder name, its vocabulary size and the number of
    training files: another corpus of as many files, or an edited file, trained on the first one's
    tokens. The key is the files' paths, sizes and times, and the tokenizer's fingerprint."""
    import shutil
    import time

    from transformers import AutoTokenizer

    target = tiny_models["llama"][0]
    tokenizer = AutoTokenizer.from_pretrained(target)
    other = tmp_path / "other-corpus"
    shutil.copytree(tiny_corpus, other)
    for path in other.iterdir():  # as many files, with other text
        path.write_text(path.read_text().replace("def ", "class "))
    cfg = {"target": str(target), "corpus_root": str(tiny_corpus), "data_file": None, "work_dir": str(tmp_path / "w"),
           "assistant_only_loss": False, "seq_len": 16}
    first = heads_training.token_streams(cfg, tokenizer)[0].tolist()
    again = heads_training.token_streams({**cfg, "corpus_root": str(other)}, tokenizer)[0].tolist()
    assert again != first and again == heads_training.token_streams({**cfg, "corpus_root": str(other)},
                                                                    tokenizer)[0].tolist()
    edited = sorted(other.iterdir())[0]
    time.sleep(0.01)
    edited.write_text("x = 1\n" + edited.read_text())
    assert heads_training.token_streams({**cfg, "corpus_root": str(other)}, tokenizer)[0].tolist() != again
    renamed = tmp_path / "same-name" / target.name  # another tokenizer in a folder of the same name
    shutil.copytree(tiny_models["qwen2"][0], renamed)
    caches = len(list((tmp_path / "w").glob("heads-train-*.npy")))
    heads_training.token_streams({**cfg, "target": str(renamed)}, AutoTokenizer.from_pretrained(renamed))
    assert len(list((tmp_path / "w").glob("heads-train-*.npy"))) == caches + 1


@pytest.mark.parametrize("trainer", ["heads", "pard"])
def test_a_number_pyyaml_reads_as_text_is_the_number(tiny_models, trainer, tmp_path):
    """`--set lr=5e-4` (as docs/training-heads.md shows) and `lr: 1e-3` are strings to PyYAML (YAML
    1.1 wants a point); torch's AdamW failed on them."""
    from draftsman.training.heads_config import config_with_overrides

    if trainer == "heads":
        config, load = {"target": str(tiny_models["llama"][0]), "out": "x"}, heads_training.load_config
    else:
        config, load = {"draft": str(tiny_models["llama"][1]), "out": "x"}, pard_training.load_config
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config) + "max_minutes: 1E1\n")
    cfg = load(config_with_overrides(str(path), ["lr=5e-4"]))
    assert (cfg["lr"], cfg["max_minutes"]) == (5e-4, 10.0)
    with pytest.raises(ValueError, match="batch_size must be a whole number, got 8.0"):  # (an int key)
        load(config_with_overrides(str(path), ["batch_size=8e0"]))


def test_set_must_be_key_equals_value(tmp_path, capsys):
    """`--set max_steps` (no "=") set max_steps to null; `--set =5` set a key ''; a value that is not
    YAML, and a work_dir that is a file, got only the parser's or the OS's words."""
    from draftsman import cli

    config = Path(__file__).parents[1] / "training" / "configs" / "medusa.yaml"
    for item in ("max_steps", "=5"):
        assert cli.main(["train", "medusa", "--config", str(config), "--set", item]) == 2
        assert f"--set '{item}' must look like KEY=VALUE, e.g. max_steps=100" in capsys.readouterr().err
    assert cli.main(["train", "medusa", "--config", str(config), "--set", f"work_dir={config}"]) == 2
    assert f"work_dir '{config}' is a file: it is the folder for token caches" in capsys.readouterr().err
    # a value that is not YAML gave the parser's words alone ("while parsing a flow node ...")
    assert cli.main(["train", "medusa", "--config", str(config), "--set", "aux_layers=[1,"]) == 2
    assert "--set 'aux_layers=[1,': the value '[1,' is not valid YAML (" in capsys.readouterr().err


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


@pytest.mark.parametrize("trainer", ["heads", "heads_eval_only", "pard", "pretrain", "vocab"])
def test_a_trainer_puts_the_callers_thread_count_back(trainer, tiny_models, tiny_corpus, tmp_path, monkeypatch):
    """Each run sets torch's thread count from its `threads` (2 here); stopped just after, with an
    error, it gives the caller its own 1 back. (A run that returns does too: test_draft_vocab's
    vocab runs with the default 2 threads, under conftest.py's one_torch_thread.)"""
    from draftsman.training.pretrain import DEFAULTS as PRETRAIN_DEFAULTS

    seen = []
    monkeypatch.setattr(torch, "manual_seed", lambda *a: seen.append(torch.get_num_threads()) or _stop())
    if trainer in ("heads", "heads_eval_only"):
        run = heads_training.evaluate_only if trainer == "heads_eval_only" else heads_training.train
        monkeypatch.setattr(heads_training, "accelerator", lambda *a: seen.append(torch.get_num_threads()) or _stop())
        call = functools.partial(run, _heads_config(tiny_models, tiny_corpus, tmp_path, "heads", threads=2))
    elif trainer == "pard":
        config = _pard_config(tiny_models, tiny_corpus, tmp_path, "pard", threads=2)
        call = functools.partial(pard_training.train, config)
    elif trainer == "pretrain":
        monkeypatch.setattr(pretrain_stages, "Ctx", lambda *a: seen.append(torch.get_num_threads()) or _stop())
        call = functools.partial(pretrain_stages.pretrain, {**PRETRAIN_DEFAULTS, "out": str(tmp_path / "zoo"),
                                                            "threads": 2})
    else:
        monkeypatch.setattr(vocab, "count", lambda *a: seen.append(torch.get_num_threads()) or _stop())
        args = argparse.Namespace(target=str(tiny_models["llama"][0]), out=str(tmp_path / "order.json"),
                                  corpus_root=str(tiny_corpus), tokens=64, seq_len=32, threads=2,
                                  work_dir=str(tmp_path / "w"), data_file=None, assistant_only=False)
        call = functools.partial(vocab.run, args)
    with pytest.raises(_Stop):
        call()
    assert seen == [2] and torch.get_num_threads() == 1
