"""Parallel drafting (PARD): `draft_model` with `parallel_drafting` drafts k tokens in one pass of
a draft model over the context and k - 1 mask tokens. Each round's drafts are what that model
computes from scratch on context + masks (the masks' keys forgotten, the emitted tokens fed next
round); greedy output is the target's own (Llama, Qwen2, GPT-2 in test_greedy_equality), sampled
output follows it; `draftsman train pard` trains every depth in one pass whose elements compute
what the drafter does, lowers the loss and writes a folder the drafter loads; bad options are named."""
import json

import pytest
import torch

import draftsman
from draftsman.training import heads as heads_training
from draftsman.training.pard import add_mask_token, parallel_logits, train

from test_engine_sampling import assert_sampled_marginals_fit
from tiny_models import load_for_reference, perturbed_copy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [40, 41, 42, 43], [9]]


def with_mask_token(source, folder):
    """The model in `source` with a mask token added as PARD checkpoints carry one (config.json
    pard_token, a row past the tokenizer's ids)."""
    model = load_for_reference(source)
    token = add_mask_token(model)
    model.save_pretrained(folder)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation")):
            (folder / f.name).write_bytes(f.read_bytes())
    return folder, token


@pytest.fixture(scope="module")
def pard_draft(tiny_models, tmp_path_factory):
    """(folder, mask token): a draft close to the tiny Llama target, with a mask token."""
    close = perturbed_copy(tiny_models["llama"][0], tmp_path_factory.mktemp("close"), noise=0.05)
    return with_mask_token(close, tmp_path_factory.mktemp("pard"))


def _decoder(target, drafter):
    return draftsman.load({"target": {"path": str(target), "device": "cpu"}, "drafter": drafter})


def test_the_mask_token_is_read_from_the_checkpoints_config(tiny_models, pard_draft):
    folder, token = pard_draft
    assert json.loads((folder / "config.json").read_text())["pard_token"] == token == 320  # past the 320 ids
    dec = _decoder(tiny_models["llama"][0], {"name": "draft_model", "path": str(folder), "parallel_drafting": True})
    assert dec.drafter.mask_token == token


def test_drafts_are_the_draft_model_run_from_scratch_on_the_context_and_masks(tiny_models, pard_draft):
    """Every round, every row: the k drafts are the argmax after the context's last token and after
    each of the k - 1 masks, as the draft model computes them over context + masks in one fresh
    pass. A cache that kept the masks' keys, or lost the emitted tokens, drafts otherwise."""
    folder, mask = pard_draft
    k = 4
    dec = _decoder(tiny_models["llama"][0], {"name": "draft_model", "path": str(folder), "k": k,
                                             "parallel_drafting": True})
    reference = load_for_reference(folder)
    propose, checked = dec.drafter.propose, []

    def checked_propose(contexts):
        trees = propose(contexts)
        for context, tree in zip(contexts, trees):
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([context + [mask] * (k - 1)])).logits[0, -k:]
            assert tree.tokens.tolist() == logits[:, : dec.engine.vocab_size].argmax(-1).tolist()
            checked.append(len(context))
        return trees

    dec.drafter.propose = checked_propose
    out = dec.generate(input_ids=PROMPTS, max_new_tokens=30, temperature=0.0)
    assert len(checked) > 4 * 8 and out.stats.tau > 1.5  # many rounds, several tokens accepted per round
    plain = _decoder(tiny_models["llama"][0], {"name": "none"}).generate(input_ids=PROMPTS, max_new_tokens=30)
    assert out.token_ids == plain.token_ids


def test_sampled_output_follows_the_target(tiny_models, pard_draft):
    """T=1: a depth-j draft is drawn from the distribution at mask j - 1, which ignores the drafts
    above it; that distribution is its q, so the first two tokens still fit the target's own."""
    dec = _decoder(tiny_models["llama"][0], {"name": "draft_model", "path": str(pard_draft[0]), "k": 3,
                                             "parallel_drafting": True})
    assert_sampled_marginals_fit(dec, tiny_models["llama"][0], [1, 2, 3, 4, 5, 1, 2, 3], 1.0)


def test_training_elements_compute_what_the_drafter_does(tiny_models):
    """Depth d + 1 at position p of the training pass (the context up to p - d, then d masks)
    gives the logits of the draft model run on exactly that: a mask that let an element see
    another chain's masks, or the text after its context, breaks the equality."""
    model = load_for_reference(tiny_models["llama"][1])
    mask = add_mask_token(model)
    x = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = parallel_logits(model, x, mask, 4)
        for d in range(4):
            for p in range(d, 12):
                alone = torch.cat([x[1, : p - d + 1], torch.full((d,), mask)])[None]
                torch.testing.assert_close(logits[d, 1, p], model(input_ids=alone).logits[0, -1], atol=1e-4, rtol=0)


def test_training_lowers_the_loss_and_writes_a_folder_the_drafter_loads(tiny_models, tiny_corpus, tmp_path):
    out = tmp_path / "pard"
    metrics = train({"draft": str(tiny_models["llama"][1]), "out": str(out), "k": 3, "work_dir": str(tmp_path / "w"),
                     "corpus_root": str(tiny_corpus), "threads": 1, "seq_len": 32, "batch_size": 4, "lr": 3e-3,
                     "warmup_steps": 2, "max_steps": 40, "eval_tokens": 256})
    curve = metrics["curve"]
    assert curve[-1][1] < curve[0][1]
    accuracy = metrics["heldout_accuracy_by_depth"]
    assert len(accuracy) == 3 and all(0 <= a <= 1 for a in accuracy)
    assert accuracy[1] > 0.1  # the masks learned the tiny corpus's repeats
    config = json.loads((out / "config.json").read_text())
    assert config["pard_token"] == metrics["pard_token"] == 320 and config["pard_k"] == 3
    target = tiny_models["llama"][0]
    dec = _decoder(target, {"name": "draft_model", "path": str(out), "k": 3, "parallel_drafting": True})
    plain = _decoder(target, {"name": "none"})
    assert (dec.generate(input_ids=PROMPTS, max_new_tokens=20).token_ids ==
            plain.generate(input_ids=PROMPTS, max_new_tokens=20).token_ids)


def test_a_killed_training_run_resumes_to_the_same_model(tiny_models, tiny_corpus, tmp_path, monkeypatch):
    """Checkpoints every step (checkpoint_minutes 0); a run killed after step 7 and started again
    with the same config ends with the weights of a run never stopped (windows are drawn by step)."""
    import draftsman.training.pard as pard
    from safetensors.torch import load_file

    def config(out):
        return {"draft": str(tiny_models["llama"][1]), "out": str(tmp_path / out), "k": 3, "threads": 1,
                "work_dir": str(tmp_path / "w"), "corpus_root": str(tiny_corpus), "seq_len": 32, "batch_size": 4,
                "lr": 3e-3, "warmup_steps": 2, "max_steps": 12, "eval_tokens": 128, "checkpoint_minutes": 0}

    whole = train(config("whole"))
    record = pard.record_step

    def killed_after_7(state, *rest):
        if state["step"] == 7:
            raise KeyboardInterrupt
        record(state, *rest)

    monkeypatch.setattr(pard, "record_step", killed_after_7)
    with pytest.raises(KeyboardInterrupt):
        train(config("resumed"))
    ckpt = heads_training.checkpoint_path(config("resumed"), "pard")
    assert ckpt.is_file()
    monkeypatch.setattr(pard, "record_step", record)
    resumed = train(config("resumed"))
    assert resumed["steps"] == whole["steps"] == 12 and resumed["curve"] == whole["curve"]
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not ckpt.exists()  # removed once the run ended


def test_adaptive_speculation_prices_a_parallel_draft_flat_in_depth(tiny_models, pard_draft):
    """One pass drafts every depth: once a round at depth 4 is measured, adaptive speculation prices
    depth 1 the same (a sequential draft model's depth 1 at a quarter of it), so it does not bet
    shallow on a price the parallel model never pays."""
    target = tiny_models["llama"][0]
    for parallel, depth_one in ((True, 0.004), (False, 0.001)):
        dec = _decoder(target, {"name": "draft_model", "path": str(pard_draft[0]), "k": 4, "adaptive": True,
                                "parallel_drafting": parallel})
        dec.drafter.record_draft_cost(1, 4, 0.004)
        assert dec.drafter.draft_cost(1).predict(1) == pytest.approx(depth_one)
        assert dec.drafter.draft_cost(2).predict(1) == pytest.approx(depth_one)  # a batch borrowing it


def test_drafting_deeper_than_the_model_was_trained_warns_at_load(tiny_models, pard_draft, tmp_path):
    """A folder `train pard` wrote records its k (config.json pard_k); drafting with more masks
    than that is allowed (still exact) but named. AMD's checkpoints record none: no warning."""
    import warnings

    folder, _ = pard_draft
    trained = tmp_path / "trained"
    trained.mkdir()
    for f in folder.iterdir():
        (trained / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (trained / "config.json").write_text(json.dumps({**config, "pard_k": 3}))
    target = tiny_models["llama"][0]
    with pytest.warns(UserWarning, match=r"k=5 drafts 4 masks, but .* was trained with k=3 .*set drafter.k to 3"):
        _decoder(target, {"name": "draft_model", "path": str(trained), "k": 5, "parallel_drafting": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _decoder(target, {"name": "draft_model", "path": str(trained), "k": 3, "parallel_drafting": True})
        _decoder(target, {"name": "draft_model", "path": str(folder), "k": 5, "parallel_drafting": True})


@pytest.mark.parametrize("options,message", [
    ({"mask_token_id": 3}, "mask_token_id is parallel_drafting's mask token; set parallel_drafting: true"),
    ({"parallel_drafting": True, "top_k": 2}, "drafts one chain per pass, not a tree .top_k=2.: set drafter.top_k"),
    ({"parallel_drafting": True}, "its config.json names none .pard_token / ptd_token_id.: set drafter.mask_token_id"),
    ({"parallel_drafting": True, "mask_token_id": 999}, "mask token 999 is outside the 320-row embedding"),
])
def test_bad_options_are_named(tiny_models, options, message):
    with pytest.raises(ValueError, match=message):
        _decoder(tiny_models["llama"][0], {"name": "draft_model", "path": str(tiny_models["llama"][1]), **options})


@pytest.mark.parametrize("config,message", [
    ({"out": "x"}, "'draft' is required"),
    ({"draft": "/no/such/folder", "out": "x"}, "no config.json in draft '/no/such/folder'"),
    ({"draft": "D", "out": "x", "k": 1}, "k must be an integer >= 2"),
    ({"draft": "D", "out": "x", "k": 32, "seq_len": 32}, "k 32 needs windows longer than seq_len 32"),
    ({"draft": "D", "out": "x", "heads": 4}, r"unknown key\(s\) \['heads'\] in the pard training config; valid keys"),
])
def test_bad_training_configs_are_named(tiny_models, config, message):
    from draftsman.training.pard import load_config

    if config.get("draft") == "D":
        config = {**config, "draft": str(tiny_models["llama"][1])}
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_config(config)


def test_out_replaces_an_earlier_parallel_model_only(tiny_models, tmp_path):
    """The trained model replaces out as a whole folder: out: the draft folder deleted the model it
    adapts, and out: zoo (a folder one up) would have deleted everything in it."""
    from draftsman.training.pard import load_config
    from draftsman.training.pretrain import save_hf_folder

    target, draft = tiny_models["llama"]
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("mine")
    for out, message in ((draft, "is the draft folder"), (target, "exists and is no parallel draft model"),
                         (files, "exists and is no parallel draft model")):
        with pytest.raises(ValueError, match=f"out '{out}' {message}.*Set out to a new folder"):
            load_config({"draft": str(draft), "out": str(out)})
    earlier = tmp_path / "earlier-pard"
    earlier.mkdir()
    (earlier / "config.json").write_text('{"pard_token": 320}')
    for out in (earlier, tmp_path / "new"):
        assert load_config({"draft": str(draft), "out": str(out)})["out"] == str(out)
    # the save itself replaces a model folder only, whoever calls it
    with pytest.raises(ValueError, match="holds no model .no config.json.: saving the model there would replace"):
        save_hf_folder(load_for_reference(draft), draft, files)
    assert [p.name for p in files.iterdir()] == ["notes.txt"]


def test_eval_only_measures_the_model_in_out_and_a_kind_other_than_pard_is_refused(tiny_models, tiny_corpus,
                                                                                    tmp_path, capsys):
    """`draftsman train --help` listed pard with [--eval-only], which `train pard` rejected; and its
    config's `kind` was dropped silently (`--set kind=medusa` trained a PARD model)."""
    import yaml

    from draftsman import cli

    config = tmp_path / "pard.yaml"
    config.write_text(yaml.safe_dump({
        "draft": str(tiny_models["llama"][1]), "out": str(tmp_path / "pard"), "k": 3, "threads": 1,
        "work_dir": str(tmp_path / "w"), "corpus_root": str(tiny_corpus), "seq_len": 32, "batch_size": 4,
        "max_steps": 2, "eval_tokens": 128}))
    assert cli.main(["train", "pard", "--config", str(config), "--eval-only"]) == 2
    assert "holds no parallel draft model to evaluate" in capsys.readouterr().err
    assert cli.main(["train", "pard", "--config", str(config), "--set", "kind=medusa"]) == 2
    assert "the config trains 'medusa' but the command asked for 'pard'" in capsys.readouterr().err
    assert not (tmp_path / "pard").exists()
    assert cli.main(["train", "pard", "--config", str(config), "--set", "kind=pard"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["heldout_accuracy_by_depth"]
    assert cli.main(["train", "pard", "--config", str(config), "--eval-only"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["kind"] == "pard" and report["heldout_accuracy_by_depth"] == pytest.approx(trained, abs=0.02)
