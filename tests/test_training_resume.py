"""A heads run killed after a checkpoint and started again ends with the weights of a run never
stopped, EAGLE's feature noise included (drawn by step, as the windows are); a checkpoint written
before the noise was drawn by step still resumes, with a notice."""
import pytest
import torch

from draftsman.training import heads as heads_training

from test_training_steps import _heads_config, trained_weights  # noqa: F401 (a fixture)


def _killed_after(monkeypatch, steps: int):
    """record_step raising after `steps` steps (a checkpoint of step `steps` is then on disk); returns
    the function that puts record_step back."""
    record = heads_training.record_step

    def killed(state, *rest):
        if state["step"] == steps:
            raise KeyboardInterrupt
        record(state, *rest)

    monkeypatch.setattr(heads_training, "record_step", killed)
    return lambda: monkeypatch.setattr(heads_training, "record_step", record)


def _eagle_config(tiny_models, tiny_corpus, tmp_path, out):
    return _heads_config(tiny_models, tiny_corpus, tmp_path, out, kind="eagle", max_steps=6, checkpoint_minutes=0,
                         feature_noise=0.2, eval_depths=2)


def test_a_killed_eagle_run_resumes_to_the_weights_of_an_uninterrupted_one(tiny_models, tiny_corpus, tmp_path,
                                                                           monkeypatch, trained_weights):  # noqa: F811
    whole = heads_training.train(_eagle_config(tiny_models, tiny_corpus, tmp_path, "whole"))
    put_back = _killed_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        heads_training.train(_eagle_config(tiny_models, tiny_corpus, tmp_path, "resumed"))
    put_back()
    resumed = heads_training.train(_eagle_config(tiny_models, tiny_corpus, tmp_path, "resumed"))
    assert resumed["steps"] == whole["steps"] == 6
    a, b = trained_weights["whole"], trained_weights["resumed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_from_before_noise_by_step_resumes_with_a_notice(tiny_models, tiny_corpus, tmp_path,
                                                                      monkeypatch, capsys):
    cfg = _eagle_config(tiny_models, tiny_corpus, tmp_path, "old")
    put_back = _killed_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        heads_training.train(cfg)
    put_back()
    ckpt = heads_training.checkpoint_path(cfg, "heads")
    saved = torch.load(ckpt, weights_only=False)
    del saved["state"]["noise_by_step"]  # as an older version wrote it
    torch.save(saved, ckpt)
    capsys.readouterr()
    assert heads_training.train(cfg)["steps"] == 6
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "will not equal an uninterrupted run's bit for bit" in out
