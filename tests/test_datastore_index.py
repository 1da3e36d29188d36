"""`draftsman datastore`: a retrieval datastore tokenized once and written as an index. Loaded, it
is the same datastore the text gives (tokens, tables, drafts, greedy output); an index made by
another tokenizer, for other n-gram sizes, or a file that is no index is refused with the fix."""
import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

import draftsman
from draftsman import cli
from draftsman.drafters import datastore_index
from draftsman.drafters.datastore import Datastore, read_documents

from tiny_models import CORPUS, load_for_reference


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("datastore-source")
    (folder / "a.py").write_text(CORPUS[0])
    (folder / "more.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in CORPUS[1:]) + "\n")
    return folder


def build(source, target, out, *sizes) -> int:
    extra = ["--min-ngram", str(sizes[0]), "--max-ngram", str(sizes[1])] if sizes else []
    return cli.main(["datastore", str(source), "--target", str(target), "--out", str(out), *extra])


def retrieval(path, **options):
    return {"name": "retrieval", "path": str(path), "k": 4, "branches": 3, **options}


def test_index_loads_the_datastore_the_text_gives(tiny_models, tiny_tokenizer, source, tmp_path, capsys):
    target, _ = tiny_models["llama"]
    out = tmp_path / "docs.safetensors"
    assert build(source, target, out, 1, 5) == 0
    assert "use it with: drafter: {name: retrieval" in capsys.readouterr().err
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644 and not list(tmp_path.glob("*.tmp"))
    from_text = Datastore.from_texts(read_documents(source), tiny_tokenizer, range(2, 5))
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(out, min_ngram=2, max_ngram=4)})
    loaded = dec.drafter.datastore
    assert torch.equal(loaded.tokens, from_text.tokens)
    assert sorted(loaded.tables) == [2, 3, 4]  # only the sizes asked for, of the 1..5 stored
    for n in (2, 3, 4):
        assert all(torch.equal(a, b) for a, b in zip(loaded.tables[n], from_text.tables[n]))
    report = dec.drafter.report()["datastore"]
    assert report["documents"] == len(CORPUS) and report["tokens"] == len(from_text) and "load_seconds" in report
    doc = tiny_tokenizer(CORPUS[2], add_special_tokens=False)["input_ids"]
    for cut in (5, 17, 40):
        assert loaded.continuations(doc[:cut], 4, 3, 256) == from_text.continuations(doc[:cut], 4, 3, 256)
    assert doc[17:21] in loaded.continuations(doc[:17], 4, 8, 256)


def test_greedy_through_an_index_equals_the_targets_generate(tiny_models, tiny_tokenizer, source, tmp_path):
    target, _ = tiny_models["llama"]
    out = tmp_path / "docs.safetensors"
    assert build(source, target, out) == 0
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t[: len(t) // 2])["input_ids"] for t in CORPUS[:2]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(out)})
    assert dec.generate(input_ids=prompts, max_new_tokens=16).token_ids == expected


def test_an_index_made_by_another_tokenizer_is_refused(tiny_models, tiny_tokenizer, source, tmp_path):
    # One tokenizer.json, but beside Qwen2's config.json it loads as Qwen2's class, which splits
    # digits one by one: the same vocabulary, other ids for the same text.
    llama, _ = tiny_models["llama"]
    qwen2, _ = tiny_models["qwen2"]
    out = tmp_path / "docs.safetensors"
    assert build(source, qwen2, out) == 0
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(qwen2).get_vocab() == tiny_tokenizer.get_vocab()
    with pytest.raises(ValueError, match="tokenized by another tokenizer than the target's.*rebuild it for this "
                                         f"target with `draftsman datastore {source} --target {llama}"):
        draftsman.load({"target": {"path": str(llama)}, "drafter": retrieval(out)})
    draftsman.load({"target": {"path": str(qwen2)}, "drafter": retrieval(out)})  # its own target loads it


def test_bad_indexes_are_refused_with_the_fix(tiny_models, source, tmp_path, capsys, monkeypatch):
    target, _ = tiny_models["llama"]
    narrow = tmp_path / "narrow.safetensors"
    assert build(source, target, narrow, 3, 4) == 0
    foreign, texts = tmp_path / "heads.safetensors", tmp_path / "texts.safetensors"
    texts.mkdir()
    (texts / "a.txt").write_text("x = 1\n")
    save_file({"w": torch.zeros(2)}, str(foreign))
    with monkeypatch.context() as m:
        m.setattr(datastore_index, "VERSION", "0")
        old = tmp_path / "old.safetensors"
        assert build(source, target, old) == 0
    cases = [(retrieval(narrow), r"holds n-gram sizes 3..4, not 2: set min_ngram / max_ngram within 3..4, or "
                                 r"rebuild it with `draftsman datastore .* --min-ngram 2 --max-ngram 4`"),
             # The commands suggested wrote over the file (refused) or into a folder (refused).
             (retrieval(foreign), "is a safetensors file but not a datastore index: build one at another path "
                                  f"with `draftsman datastore TEXT --target {target} --out {tmp_path / 'datastore'}"),
             (retrieval(texts), "is a folder: give an index file, built with `draftsman datastore TEXT"),
             (retrieval(tmp_path / "missing.safetensors"),
              "'.*missing.safetensors' does not exist; it should be the datastore: .*`draftsman datastore`"),
             (retrieval(old), "has format version 0, this draftsman reads version 1: rebuild it")]
    for drafter, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            draftsman.load({"target": {"path": str(target)}, "drafter": drafter})
    draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(narrow, min_ngram=3)})

    capsys.readouterr()
    assert build(source, target, tmp_path / "docs.bin") == 2
    assert "must end in .safetensors" in capsys.readouterr().err and not (tmp_path / "docs.bin").exists()
    assert build(source, target, tmp_path / "x.safetensors", 3, 2) == 2
    assert "need 1 <= --min-ngram <= --max-ngram" in capsys.readouterr().err
    assert build(tmp_path / "nothing", target, tmp_path / "x.safetensors") == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()


def test_an_index_replaces_an_earlier_index_only(tiny_models, source, tmp_path, capsys):
    """--out model.safetensors (a model's weights share the suffix) was written over without a word."""
    target, _ = tiny_models["llama"]
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights))
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not safetensors")
    folder = tmp_path / "folder.safetensors"
    folder.mkdir()
    before = {path: path.read_bytes() for path in (weights, junk)}
    for out, named in ((weights, "exists and is not a datastore index"), (junk, "exists and is not a datastore"),
                       (folder, "is a folder: give the index file's path")):
        assert build(source, target, out) == 2
        assert named in capsys.readouterr().err
    assert {path: path.read_bytes() for path in before} == before and not any(folder.iterdir())
    index = tmp_path / "docs.safetensors"
    assert build(source, target, index, 3, 4) == 0 and build(source, target, index, 2, 4) == 0  # a rebuild
    draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(index, min_ngram=2)})


def test_a_damaged_index_is_refused_at_load_with_the_rebuild(tiny_models, source, tmp_path, capsys):
    """A cut or garbage file was a raw SafetensorError; a cut `tokens` tensor loaded and crashed
    mid-generation (IndexError); a missing table was "File does not contain tensor keys.3"."""
    from safetensors import safe_open

    target, _ = tiny_models["llama"]
    good = tmp_path / "good.safetensors"
    assert build(source, target, good) == 0
    with safe_open(str(good), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    data = good.read_bytes()

    def written(name, raw=None, **changed):
        path = tmp_path / f"{name}.safetensors"
        if raw is not None:
            path.write_bytes(raw)
        else:
            kept = {k: v for k, v in {**tensors, **changed}.items() if v is not None}
            save_file(kept, str(path), metadata=meta)
        return path

    rebuild = "rebuild it with `draftsman datastore .* --target .* --out .*{}"
    cases = [(written("cut", data[: len(data) // 2]), "incomplete metadata"),
             (written("header", data[:40]), "invalid header length"),
             (written("garbage", b"\xff" * 4096), "header too large"),
             (written("short", tokens=tensors["tokens"][:5].clone()), "keys.2 and positions.2 hold .* for 5 tokens"),
             (written("missing", **{"keys.3": None}), "no tensor keys.3"),
             (written("moved", **{"positions.4": tensors["positions.4"] + 10**6}), "positions.4 outside"),
             (written("floats", tokens=tensors["tokens"].float()), "tokens is 1-D torch.float32, not 1-D integers"),
             (written("negative", tokens=tensors["tokens"] - 5), "token id -")]
    for path, damage in cases:
        with pytest.raises(ValueError, match=f"index '{path}' is damaged \\(.*{damage}.*\\): .*"
                                             + rebuild.format(path.name)):
            draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(path)})
    # The rebuild suggested: over a cut index (its header names it) it is written; over a file
    # that is no safetensors at all it is refused as before, now saying so.
    assert build(source, target, tmp_path / "cut.safetensors") == 0
    draftsman.load({"target": {"path": str(target)}, "drafter": retrieval(tmp_path / "cut.safetensors")})
    capsys.readouterr()
    assert build(source, target, tmp_path / "garbage.safetensors") == 2
    assert "is not readable safetensors (" in capsys.readouterr().err
    assert (tmp_path / "garbage.safetensors").read_bytes() == b"\xff" * 4096
