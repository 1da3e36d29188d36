"""Files written whole or not at all (draftsman/atomic_files.py): an interrupted write (Ctrl-C, a
full disk) leaves the previous file as it was and no partial file beside it. The token cache and
a drafter's memory have their own tests (test_training_steps.py, test_drafter_memory.py)."""
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from draftsman.atomic_files import replaced_whole
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


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError("No space left on device")])
def test_an_interrupted_checkpoint_leaves_the_last_one(tmp_path, monkeypatch, error):
    ckpt = tmp_path / "ckpt.pt"
    pretrain.atomic_torch_save({"step": 1}, ckpt)
    monkeypatch.setattr(torch, "save", half_then(error))
    with pytest.raises(type(error)):
        pretrain.atomic_torch_save({"step": 2}, ckpt)
    monkeypatch.undo()
    assert torch.load(ckpt)["step"] == 1 and list(tmp_path.iterdir()) == [ckpt]


def test_an_interrupted_heads_save_leaves_the_last_weights(tmp_path, monkeypatch):
    heads_common.save_checkpoint(tmp_path, {"kind": "medusa"}, {"w": torch.ones(2)})
    monkeypatch.setattr(heads_common, "save_file", half_then(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        heads_common.save_checkpoint(tmp_path, {"kind": "medusa"}, {"w": torch.zeros(2)})
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in tmp_path.iterdir())
