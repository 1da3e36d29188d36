"""The `retrieval` drafter (REST-style datastore lookup): continuations that followed the context's
longest matching suffix, most frequent first, cut at document boundaries; greedy output equals the
target's own generate at batch 1 and 4; sampling stays the target's (audit chi-square); bad
datastores are refused with the fix named."""
import json

import pytest
import torch

import draftsman
from draftsman.audit import format_report, run_audit
from draftsman.drafters.datastore import BOUNDARY, Datastore, read_documents
from draftsman.verifier.sampling import SamplingParams

from tiny_models import CORPUS, load_for_reference

NEW = 24


def store(tokens: list[int], sizes=range(1, 4)) -> Datastore:
    return Datastore(torch.tensor(tokens), sizes)


def test_longest_suffix_first_then_most_frequent_continuations():
    s = store([7, 1, 2, 3, BOUNDARY, 9, 2, 5, 6, BOUNDARY, 8, 2, 5, 6, BOUNDARY, 4, 2, 3, 1])
    # The longest suffix found is [9, 2]: its one continuation, cut at the boundary, beats [2]'s.
    assert s.continuations([0, 9, 2], k=3, branches=3, max_matches=64) == [[5, 6]]
    # [2] alone is followed by 3 | 5 6 | 5 6 | 3 1: the twice-seen first, then datastore order.
    assert s.continuations([0, 2], k=2, branches=3, max_matches=64) == [[5, 6], [3], [3, 1]]
    assert s.continuations([0, 2], k=2, branches=1, max_matches=64) == [[5, 6]]
    # k past the datastore's end: the last continuation stops there as at a boundary.
    assert s.continuations([0, 2], k=4, branches=3, max_matches=64) == [[5, 6], [3], [3, 1]]
    assert s.continuations([42], k=2, branches=3, max_matches=64) == []  # nowhere in the datastore


def test_a_datastore_shorter_than_the_longest_ngram_has_no_windows_of_it():
    """max_ngram 100 on a short text failed with "The size of tensor a (0) must match the size of
    tensor b" (a negative window count wrapped the slices round)."""
    s = Datastore(torch.tensor([7, 1, 2, 3]), range(2, 8))
    assert all(s.tables[n][0].numel() == 0 for n in range(5, 8)) and s.tables[2][0].numel() == 2
    assert s.continuations([0, 7, 1], k=2, branches=1, max_matches=64) == [[2, 3]]

def test_max_matches_reads_the_first_occurrences_and_collisions_are_filtered(monkeypatch):
    s = store([1, 5, BOUNDARY, 1, 6, BOUNDARY, 1, 6, BOUNDARY])
    assert s.continuations([1], k=1, branches=2, max_matches=1) == [[5]]
    assert s.continuations([1], k=1, branches=2, max_matches=9) == [[6], [5]]
    import draftsman.drafters.datastore as D
    monkeypatch.setattr(D, "window_hashes", lambda tokens, n: torch.zeros(max(tokens.numel() - n + 1, 0),
                                                                          dtype=torch.long))
    collided = D.Datastore(torch.tensor([1, 5, BOUNDARY, 3, 7, BOUNDARY]), range(1, 2))  # every window hashes to 0
    assert collided.continuations([3], k=1, branches=2, max_matches=9) == [[7]]


@pytest.fixture(scope="module")
def datastore_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("datastore")
    (folder / "a.py").write_text(CORPUS[0])
    (folder / "sub").mkdir()
    (folder / "sub" / "more.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in CORPUS[1:]) + "\n")
    (folder / "blob.bin").write_bytes(b"\xff\xfe\x00")  # not text: skipped
    (folder / ".git").mkdir()
    (folder / ".git" / "config").write_text("[core]\n\tbare = false\n")  # hidden: skipped
    return folder


def test_documents_come_from_files_jsonl_lines_and_folders(datastore_dir, tiny_tokenizer):
    texts = read_documents(datastore_dir)
    assert sorted(texts) == sorted(CORPUS)
    s = Datastore.from_texts(texts, tiny_tokenizer, range(2, 4))
    assert len(s) == sum(len(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) for t in CORPUS)
    doc = tiny_tokenizer(CORPUS[0], add_special_tokens=False)["input_ids"]
    assert doc[10:14] in s.continuations(doc[:10], k=4, branches=50, max_matches=256)  # the text as written
    with pytest.raises(FileNotFoundError, match="datastore path '/no/such' does not exist"):
        read_documents("/no/such")


def drafter_config(path):
    return {"name": "retrieval", "path": str(path), "k": 4, "branches": 3}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_target_generate_batch_1_and_4(arch, tiny_models, tiny_tokenizer, datastore_dir):
    target, _ = tiny_models[arch]
    model = load_for_reference(target)
    prompts = [tiny_tokenizer(t[: len(t) // 2])["input_ids"] for t in CORPUS[:4]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in prompts]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": drafter_config(datastore_dir)})
    assert dec.drafter.report()["datastore"]["documents"] == len(CORPUS)
    # A random target seldom writes the corpus, and its bytes do not survive decoding and
    # tokenizing again: so the datastore also gets the first half of its own greedy tokens, and
    # long drafts are accepted (the accept path and its cache moves run too).
    own = [t for p, e in zip(prompts, expected) for t in p + e[: NEW // 2] + [BOUNDARY]]
    corpus = dec.drafter.datastore.tokens
    dec.drafter.datastore = Datastore(torch.cat([corpus, torch.tensor(own)]), dec.drafter.datastore.sizes)
    assert [dec.generate(input_ids=[p], max_new_tokens=NEW).token_ids[0] for p in prompts] == expected
    out = dec.generate(input_ids=prompts, max_new_tokens=NEW)
    assert out.token_ids == expected
    assert out.stats.tau > 1.3, out.stats.tau


def test_sampling_stays_the_targets(tiny_models, tiny_tokenizer, datastore_dir):
    target, _ = tiny_models["llama"]
    dec = draftsman.load({"target": {"path": str(target)}, "drafter": drafter_config(datastore_dir)})
    prompt = tiny_tokenizer(CORPUS[0][:60])["input_ids"]
    result = run_audit(dec, [prompt], sampling=SamplingParams(1.0), max_new_tokens=8, sample_prompts=1,
                       samples=500, positions=2, checks=("sampling",))
    assert result["passed"], format_report(result)


def test_bad_datastores_are_refused(tiny_models, tmp_path):
    target, _ = tiny_models["llama"]
    cases = [({"name": "retrieval"}, "retrieval: path is required"),
             (drafter_config(tmp_path / "missing"), "does not exist"),
             ({**drafter_config(tmp_path), "min_ngram": 3, "max_ngram": 2}, "need 1 <= min_ngram <= max_ngram")]
    (tmp_path / "bad.jsonl").write_text('{"txt": "typo"}\n')
    cases.append((drafter_config(tmp_path / "bad.jsonl"), 'bad.jsonl:1: each JSONL line of a datastore needs a "text"'))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    cases.append((drafter_config(tmp_path / "empty"), "holds no text"))
    for drafter, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
            draftsman.load({"target": {"path": str(target)}, "drafter": drafter})


def test_a_file_that_is_not_utf8_is_named_and_upper_case_jsonl_is_jsonl(tmp_path):
    """One Latin-1 file was reported as holding "no text"; UP.JSONL was read as plain text, braces and all."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café = 1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"'.*latin1.txt' is not UTF-8 text \(.* at byte 3\): save it as UTF-8"):
        read_documents(latin1)
    folder = tmp_path / "only-latin1"
    folder.mkdir()
    (folder / "a.txt").write_bytes(latin1.read_bytes())
    with pytest.raises(ValueError, match="holds no text to look drafts up in .*skipped as not UTF-8 text.*a.txt"):
        read_documents(folder)
    upper = tmp_path / "UP.JSONL"
    upper.write_text(json.dumps({"text": "x = 1"}) + "\n")
    assert read_documents(upper) == ["x = 1"]
