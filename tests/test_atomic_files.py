"""Files written whole or not at all (draftsman/atomic_files.py): an interrupted write (Ctrl-C, a
full disk) leaves the previous file as it was and no partial file beside it. The token cache and
a drafter's memory have their own tests (test_training_steps.py, test_drafter_memory.py)."""
import json
import os
import shutil
import stat

import pytest
import torch

from draftsman.atomic_files import replaced_together, replaced_whole
from draftsman.heads import common as heads_common
from draftsman.training import pretrain


def half_then(error):
    def write(*args, **kwargs):
        target = next(a for a in (*args, *kwargs.values()) if isinstance(a, (str, os.PathLike)))
        with open(target, "wb") as f:
            f.write(b"half a file")
        raise error
    return write


def test_the_block_replaces_the_file_or_leaves_it(tmp_path):
    path = tmp_path / "f.json"
    with replaced_whole(path, mode=0o644) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_text("one")
    assert path.read_text() == "one" and stat.S_IMODE(path.stat().st_mode) == 0o644
    for error in (KeyboardInterrupt(), OSError("No space left on device")):
        with pytest.raises(type(error)):
            with replaced_whole(path) as tmp:
                half_then(error)(tmp)
        assert path.read_text() == "one" and list(tmp_path.iterdir()) == [path]


def test_two_writers_of_one_file_each_write_their_own_temporary(tmp_path):
    """Two processes saving one memory file shared path + .tmp: one renamed the other's away and its
    rename failed ("No such file or directory"). Each writer's temporary is its own; the last rename wins."""
    path = tmp_path / "memory.safetensors"
    with replaced_whole(path) as shared:  # a checkpoint's: a SIGKILL's half is overwritten by the next save
        assert shared == tmp_path / "memory.safetensors.tmp"
        shared.write_text("shared")
    with replaced_whole(path, per_writer=True) as first:
        first.write_text("first")
        with replaced_whole(path, per_writer=True) as second:
            assert first != second and first.parent == second.parent == tmp_path
            second.write_text("second")
        assert path.read_text() == "second" and first.read_text() == "first"
    assert path.read_text() == "first" and list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError("No space left on device")])
def test_an_interrupted_checkpoint_leaves_the_last_one(tmp_path, monkeypatch, error):
    ckpt = tmp_path / "ckpt.pt"
    pretrain.atomic_torch_save({"step": 1}, ckpt)
    monkeypatch.setattr(torch, "save", half_then(error))
    with pytest.raises(type(error)):
        pretrain.atomic_torch_save({"step": 2}, ckpt)
    monkeypatch.undo()
    assert torch.load(ckpt)["step"] == 1 and list(tmp_path.iterdir()) == [ckpt]


def test_files_replaced_together_change_only_after_all_are_written(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    with replaced_together([a, b], mode=0o644) as (tmp_a, tmp_b):
        tmp_a.write_text("a1")
        tmp_b.write_text("b1")
        assert not a.exists() and not b.exists()  # nothing renamed while the block writes
    assert (a.read_text(), b.read_text()) == ("a1", "b1")
    assert stat.S_IMODE(b.stat().st_mode) == 0o644
    with pytest.raises(KeyboardInterrupt):
        with replaced_together([a, b]) as (tmp_a, tmp_b):
            tmp_a.write_text("a2")  # the first is written whole; the second is interrupted
            half_then(KeyboardInterrupt())(tmp_b)
    assert (a.read_text(), b.read_text()) == ("a1", "b1") and sorted(tmp_path.iterdir()) == [a, b]


@pytest.mark.parametrize("interrupted", ["save_file", "write_text"])
def test_an_interrupted_heads_save_leaves_the_last_pair(tmp_path, monkeypatch, interrupted):
    heads_common.save_checkpoint(tmp_path, {"kind": "medusa", "num_heads": 1}, {"w": torch.ones(2)})
    if interrupted == "save_file":
        monkeypatch.setattr(heads_common, "save_file", half_then(KeyboardInterrupt))
    else:  # the weights are written by then: the config's write must not let them in alone
        monkeypatch.setattr(type(tmp_path), "write_text", half_then(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        heads_common.save_checkpoint(tmp_path, {"kind": "medusa", "num_heads": 2}, {"w": torch.zeros(2)})
    monkeypatch.undo()
    config, tensors = heads_common.load_checkpoint(tmp_path, "medusa")
    assert config["num_heads"] == 1 and torch.equal(tensors["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in tmp_path.iterdir())


def test_a_config_and_weights_of_two_saves_are_refused(tmp_path):
    """What a kill between the two renames leaves: one save's config beside another's weights."""
    first, second = tmp_path / "first", tmp_path / "second"
    heads_common.save_checkpoint(first, {"kind": "medusa", "num_heads": 1}, {"w": torch.ones(2)})
    heads_common.save_checkpoint(second, {"kind": "medusa", "num_heads": 2}, {"w": torch.zeros(3)})
    shutil.copy(second / "config.json", first / "config.json")
    with pytest.raises(ValueError, match="two different saves.*save or train the heads again"):
        heads_common.load_checkpoint(first, "medusa")
    # a config edited by hand keeps its save's id and loads; so does a folder saved before save ids
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    assert heads_common.load_checkpoint(second, "medusa")[0]["note"] == "edited"
    del config[heads_common.SAVE_ID]
    (first / "config.json").write_text(json.dumps(config))
    assert torch.equal(heads_common.load_checkpoint(first, "medusa")[1]["w"], torch.ones(2))


def test_heads_are_saved_over_earlier_heads_only(tmp_path, tiny_models):
    """Heads training with out: set to the target's folder (its line copied one up in the YAML)
    replaced the target's config.json and weights with the heads', hours into the run. The check
    runs when the training config loads and again at every save."""
    from draftsman.training.heads import load_config

    target = tiny_models["llama"][0]
    elsewhere = tmp_path / "not-json"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{oops")
    before = {p: p.read_bytes() for folder in (target, elsewhere) for p in folder.iterdir()}
    for folder, found in ((target, "holds a 'llama' model"), (elsewhere, "holds a config.json no heads save wrote")):
        with pytest.raises(ValueError, match=f"{found}: saving heads there would replace its config.json"):
            heads_common.save_checkpoint(folder, {"kind": "medusa"}, {"w": torch.ones(2)})
        with pytest.raises(ValueError, match=f"out '{folder}' {found}"):
            load_config({"kind": "medusa", "target": str(target), "out": str(folder)})
    assert {p: p.read_bytes() for p in before} == before
    heads = tmp_path / "heads"
    for count in (1, 2):  # a new folder, then earlier heads: saved
        heads_common.save_checkpoint(heads, {"kind": "medusa", "num_heads": count}, {"w": torch.ones(2)})
        assert load_config({"kind": "medusa", "target": str(target), "out": str(heads)})["out"] == str(heads)
    assert heads_common.load_checkpoint(heads, "medusa")[0]["num_heads"] == 2


def test_heads_are_not_saved_over_files_weights_or_other_heads(tmp_path, tiny_models):
    """A file as out failed only at the save, hours in ('[Errno 17] File exists'); a folder of weights
    or metrics without a config.json, and another kind's heads, were replaced without a word."""
    from draftsman.training.heads import load_config

    target = tiny_models["llama"][0]
    a_file = tmp_path / "a-file"
    a_file.write_text("notes")
    weights, metrics, eagle = tmp_path / "weights", tmp_path / "metrics", tmp_path / "eagle"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"someone's weights")
    metrics.mkdir()
    (metrics / "metrics.json").write_text("{}")
    heads_common.save_checkpoint(eagle, {"kind": "eagle"}, {"w": torch.ones(2)})
    before = {p: p.read_bytes() for p in (a_file, *weights.iterdir(), *metrics.iterdir(), *eagle.iterdir())}
    for folder, message in ((a_file, "is a file: heads are saved in a folder"),
                            (weights, "holds model.safetensors without a config.json: saving heads there would "
                                      "replace them"),
                            (metrics, "holds metrics.json without a config.json"),
                            (eagle, "holds eagle heads: saving medusa heads there would replace them")):
        with pytest.raises(ValueError, match=f"out '{folder}' {message}"):
            load_config({"kind": "medusa", "target": str(target), "out": str(folder)})
    assert {p: p.read_bytes() for p in before} == before
    assert load_config({"kind": "eagle", "target": str(target), "out": str(eagle)})["out"] == str(eagle)
