"""The bundled demo pair (zoo/) and the pipeline that builds it (draftsman.training).

Zoo tests skip until `make zoo` has produced zoo/python-target and zoo/python-draft; the
pipeline tests run a tiny corpus through tokenizer -> draft -> target -> pair in a tmp dir.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsman.training import corpus as C
from draftsman.training import pretrain as P
from draftsman.training import tokenizer as T

# ---------------------------------------------------------------- the bundled zoo


def _zoo():
    from draftsman import zoo

    try:
        return zoo.target_path(), zoo.draft_path()
    except FileNotFoundError as e:
        pytest.skip(f"zoo not built yet: {e}")


@pytest.fixture(scope="module")
def zoo_pair():
    t, d = _zoo()
    if not (t / "metrics.json").exists() or not (d / "metrics.json").exists():
        pytest.skip("zoo models have no metrics.json yet (training not finished)")
    return t, d


@pytest.fixture(scope="module")
def offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def zoo_models(zoo_pair, offline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t, d = zoo_pair
    tok = AutoTokenizer.from_pretrained(t)
    tgt = AutoModelForCausalLM.from_pretrained(t, dtype=torch.float32).eval()
    drf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return tok, tgt, drf


def test_zoo_folders_are_standard(zoo_pair):
    for p in zoo_pair:
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "metrics.json"):
            assert (p / f).is_file(), p / f
        assert all(v.dtype == torch.bfloat16 for v in load_file(p / "model.safetensors").values())
        gen = json.loads((p / "generation_config.json").read_text())
        assert gen["eos_token_id"] == gen["bos_token_id"] == gen["pad_token_id"] == 0
    size = sum((p / "model.safetensors").stat().st_size for p in zoo_pair)
    assert size <= 80e6


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp", "medusa", "mlp_speculator"])
def test_bundled_heads_load_and_draft_exactly(zoo_pair, offline, kind):
    """Each bundled heads folder: small bf16 weights (EAGLE-3's draft-vocabulary ids exact, int64),
    metrics, a token-frequency order; it loads against the bundled target and its greedy output
    equals plain decoding."""
    import draftsman
    from draftsman import zoo

    name = f"python-{kind.replace('_', '-')}"
    folder = zoo.heads_path(name)
    if folder is None:
        pytest.skip(f"zoo/{name} not trained yet (zoo/train_heads.sh)")
    assert (folder / "metrics.json").is_file() and (folder / "model.safetensors").stat().st_size < 12e6
    tensors = load_file(folder / "model.safetensors")
    assert all(v.dtype == (torch.int64 if k == "draft_token_ids" else torch.bfloat16) for k, v in tensors.items())
    assert len(json.loads((folder / "config.json").read_text())["tokens_by_frequency"]) == 8192
    base = draftsman.load({"target": {"path": str(zoo_pair[0])}})
    prompt = base.encode([zoo.heldout_files()[0].read_text()[:600]])  # held-out Python source
    plain = base.generate(input_ids=prompt, max_new_tokens=24)
    options = {"name": "eagle"} if kind == "eagle3" else {"name": kind, "draft_vocab": 1024}  # eagle3: its own
    out = base.with_drafter({**options, "path": str(folder)}).generate(input_ids=prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids


def test_bundled_parallel_draft_model_drafts_exactly_in_one_pass(zoo_pair, offline):
    """zoo/python-pard (`draftsman train pard` from the bundled draft model): its mask token in
    config.json, the target's token order beside it, metrics per depth; drafting as the demo
    configs run it (4 per pass, 1024-row head), its greedy output equals plain decoding."""
    import draftsman
    from draftsman import zoo

    folder = zoo.heads_path("python-pard")
    if folder is None:
        pytest.skip("zoo/python-pard not trained yet (training/configs/pard.yaml)")
    config = json.loads((folder / "config.json").read_text())
    assert config["pard_token"] == config["vocab_size"] - 1 == 8192  # a row past the tokenizer's ids
    assert len(json.loads((folder / "metrics.json").read_text())["heldout_accuracy_by_depth"]) == 4
    assert (folder / "tokens_by_frequency.json").is_file()
    base = draftsman.load({"target": {"path": str(zoo_pair[0])}})
    prompt = base.encode([zoo.heldout_files()[0].read_text()[:600]])
    plain = base.generate(input_ids=prompt, max_new_tokens=24)
    dec = base.with_drafter({"name": "draft_model", "path": str(folder), "k": 4, "parallel_drafting": True,
                             "draft_vocab": 1024})
    out = dec.generate(input_ids=prompt, max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.stats.tau > 1.2


def test_zoo_tokenizer_roundtrips_heldout_files(zoo_models):
    from draftsman import zoo

    tok = zoo_models[0]
    assert tok.eos_token == tok.bos_token == tok.pad_token == C.EOT
    texts = [t for t in map(C.read_text, zoo.heldout_files()[:6]) if t]
    assert texts
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def heldout_losses(zoo_pair, zoo_models, tmp_path_factory):
    """(target, draft) held-out loss on metrics.json's fixed sample definition: evenly spaced windows
    over the held-out stream of this interpreter's stdlib."""
    t, _ = zoo_pair
    _, tgt, drf = zoo_models
    sd = json.loads((t / "metrics.json").read_text())["small_sample_definition"]
    held = P.token_stream(C.split_files()[1], t, tmp_path_factory.mktemp("held") / "held.npy")
    windows = P.heldout_windows(held, sd["tokens"], sd["seq_len"])
    return P.heldout_loss(tgt, windows), P.heldout_loss(drf, windows)


def test_zoo_target_beats_draft_on_heldout_text(zoo_pair, heldout_losses):
    t, d = zoo_pair
    lt, ld = heldout_losses
    assert ld > lt
    final = {p: json.loads((p / "metrics.json").read_text())["final_heldout_loss"] for p in (t, d)}
    assert final[d] - final[t] >= 0.3


def test_zoo_heldout_loss_matches_metrics(zoo_pair, heldout_losses):
    """The held-out text is this interpreter's stdlib: metrics.json's figures hold on the stdlib
    they were measured on (another Python, e.g. 3.12 on a GPU machine, holds other files)."""
    t, d = zoo_pair
    mt, md = (json.loads((p / "metrics.json").read_text()) for p in (t, d))
    train, held = C.split_files()
    measured_on = mt["corpus"]
    if (measured_on["python_version"], measured_on["train_files"], measured_on["heldout_files"]) != \
            (C.python_version(), len(train), len(held)):
        pytest.skip(f"metrics.json was measured on Python {measured_on['python_version']}'s stdlib "
                    f"({measured_on['heldout_files']} held-out files); this is Python {C.python_version()} "
                    f"({len(held)}): other held-out text")
    lt, ld = heldout_losses
    assert abs(lt - mt["small_sample_heldout_loss"]) < 0.02
    assert abs(ld - md["small_sample_heldout_loss"]) < 0.02


# ---------------------------------------------------------------- pipeline pieces


def test_split_is_deterministic_and_disjoint(tmp_path):
    train, held = C.split_files()
    assert C.split_files() == (train, held)
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(C.list_files())
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.09
    assert not any("site-packages" in str(p) for p in train + held)
    # The split depends only on the relative path, not on where the tree lives.
    for root in (tmp_path / "a", tmp_path / "b" / "c"):
        for i in range(40):
            (root / "pkg").mkdir(parents=True, exist_ok=True)
            (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    rel = lambda files, r: sorted(p.relative_to(r).as_posix() for p in files)  # noqa: E731
    a, b = C.split_files(tmp_path / "a", 20), C.split_files(tmp_path / "b" / "c", 20)
    assert rel(a[1], tmp_path / "a") == rel(b[1], tmp_path / "b" / "c")


def test_tokenizer_trainer_roundtrips(tmp_path):
    from transformers import AutoTokenizer

    texts = ["def f(x):\n    return x + 1\n", "class A:\n\tpass\r\n", "s = 'héllo wörld ✓'\n  \n"] * 20
    tok = T.train_tokenizer(texts, vocab_size=300)
    T.save_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.convert_tokens_to_ids(C.EOT) == 0 == hf.eos_token_id
    for s in texts[:3] + ["  leading spaces, 🐍 and \x00 bytes\n"]:
        ids = hf(s, add_special_tokens=False)["input_ids"]
        assert hf.decode(ids) == s


def test_unknown_config_keys_raise():
    with pytest.raises(ValueError, match="valid keys"):
        P.load_config({"modles": {}})
    with pytest.raises(ValueError, match="hidden_size"):
        P.load_config({"models": {"draft": {"hiden_size": 3}}})


def _tiny_config(tmp_path: Path, out: str) -> dict:
    src = tmp_path / "corpus"
    if not src.exists():
        # Real stdlib text (a few small modules) under made-up names: enough for BPE + windows.
        mods = [C.read_text(C.stdlib_root() / f) for f in ("bisect.py", "colorsys.py", "keyword.py", "this.py")]
        for i in range(24):
            (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
            (src / f"d{i % 3}" / f"m{i}.py").write_text(mods[i % len(mods)] + f"\n# file {i}\n")
    model = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "seq_len": 32,
             "batch_size": 2, "warmup_steps": 2, "max_steps": 4, "eval_minutes": 100}
    return {
        "out": str(tmp_path / out), "work_dir": str(tmp_path / out / ".work"), "threads": 1,
        "mixed_precision": "no", "checkpoint_minutes": 100,
        "corpus": {"root": str(src), "heldout_percent": 25},
        "tokenizer": {"vocab_size": 320},
        "eval": {"heldout_tokens": 1024, "periodic_tokens": 256, "seq_len": 32, "small_tokens": 256},
        "models": {"draft": {**model, "tie_embeddings": True},
                   "target": {**model, "hidden_size": 48, "num_layers": 2}},
    }


def test_tiny_pretraining_writes_hf_folders_and_resumes_exactly(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _tiny_config(tmp_path, "full")
    res = P.pretrain(cfg, command="test")
    out = Path(cfg["out"])
    for name in ("draft", "target"):
        d = out / f"python-{name}"
        m = json.loads((d / "metrics.json").read_text())
        assert m["steps"] == 4 and m["tokens_seen"] == 4 * 2 * 32 and m["params"] > 0
        assert m["heldout_curve"][0][0] == 0 and m["heldout_curve"][-1][0] == 4
        assert m["corpus"]["heldout_files"] > 0 and m["versions"]["torch"] == torch.__version__
        assert AutoModelForCausalLM.from_pretrained(d).config.max_position_embeddings >= 1024
        AutoTokenizer.from_pretrained(d)
    assert 0 <= res["pair"]["greedy_agreement"] <= 1
    assert (out / "pair_metrics.json").is_file()

    # Kill the draft after 2 steps (checkpoint left behind), rerun: it resumes and ends bit-identical.
    cfg2 = _tiny_config(tmp_path, "killed")
    assert P.pretrain(cfg2, only="tokenizer")
    assert P.pretrain(cfg2, only="draft", stop_after=2)["draft"] is None
    assert not (Path(cfg2["out"]) / "python-draft").exists()
    m = P.pretrain(cfg2, only="draft")["draft"]
    assert m["resumed_from_steps"] == [2] and m["steps"] == 4
    a = load_file(out / "python-draft" / "model.safetensors")
    b = load_file(Path(cfg2["out"]) / "python-draft" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A finished stage with the same config is skipped, not retrained.
    assert P.pretrain(cfg2, only="draft")["draft"]["resumed_from_steps"] == [2]


def test_two_processes_follow_the_main_processs_plan_and_clock(tmp_path):
    """Under torchrun the time budget's step count, and when to evaluate or checkpoint, come from
    the main process's clock: process 1's own (100000 times fast) would plan it a few steps and
    stop it, and would take it into the evaluation's or the checkpoint's barrier at other steps than
    its peer, which then waits in a gradient all-reduce until the run fails."""
    from test_training_steps import two_processes_with_a_fast_clock_on_one

    cfg = _tiny_config(tmp_path, "two")
    cfg["models"]["draft"].update(max_steps=10000, max_minutes=0.03, warmup_steps=20, probe_steps=4,
                                  replan_every=5, eval_minutes=0.5)
    cfg["checkpoint_minutes"] = 0.5
    P.pretrain(cfg, only="tokenizer")
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(cfg))
    run = two_processes_with_a_fast_clock_on_one("draftsman.training.pretrain", "--config", tmp_path / "two.yaml",
                                                 "--only", "draft")
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads((Path(cfg["out"]) / "python-draft" / "metrics.json").read_text())
    assert m["num_processes"] == 2 and 4 < m["steps"] < 10000
    assert [step for step, *_ in m["heldout_curve"]] == [0, m["steps"]]  # at the start and the end only


def test_time_budget_plans_steps(tmp_path):
    cfg = _tiny_config(tmp_path, "budget")
    cfg["models"]["draft"].update(max_steps=10000, max_minutes=0.03, warmup_steps=20, probe_steps=4,
                                  replan_every=5)
    P.pretrain(cfg, only="tokenizer")
    m = P.pretrain(cfg, only="draft")["draft"]
    assert 4 < m["steps"] < 10000 and m["sec_per_step"] > 0
    assert m["wall_seconds"] < 30
