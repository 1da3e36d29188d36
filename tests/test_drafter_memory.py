"""A drafter's memory across restarts (`memory_file`, drafters/memory_file.py): the `suffix`
cache of outputs and the `recycling` candidate matrix are written by Decoder.save_drafter_memory
(and by the CLI when it ends) and loaded by the next process's drafter as they were; a memory
written for another target, tokenizer or drafter is refused and left as it is."""
import errno
import io
import json
import signal
import sys
import threading
import time
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

import draftsman
from draftsman.cli import main
from draftsman.drafters import memory_file
from draftsman.serve_batch import Batcher, ServerStopping

from serving import call, running, slow_serve_process
from tiny_models import load_for_reference

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7, 6], [5, 5, 6, 6, 7]]


def decoder(folder, drafter: dict):
    return draftsman.load({"target": {"path": str(folder)}, "drafter": drafter})


def greedy(folder, prompt: list[int], n: int) -> list[int]:
    model = load_for_reference(folder)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def cached_rows(drafter) -> list[list[int]]:
    return [list(row) for row in drafter.cache.sequences.values()]


def test_a_restarted_recycling_drafter_starts_from_the_saved_matrix(tiny_models, tmp_path):
    folder, path = tiny_models["llama"][0], tmp_path / "memory" / "recycling.safetensors"
    first = decoder(folder, {"name": "recycling", "memory_file": str(path)})
    assert first.drafter.matrix.known_tokens() == 0 and not path.exists()  # a first start: empty
    first.generate(input_ids=PROMPTS, max_new_tokens=12, temperature=0.0)
    assert first.save_drafter_memory() == [str(path)]
    saved = first.drafter.matrix.ids.clone()
    assert sorted(p.name for p in path.parent.iterdir()) == ["recycling.safetensors"]  # no .tmp left

    again = decoder(folder, {"name": "recycling", "memory_file": str(path)})
    assert again.drafter.matrix.known_tokens() == first.drafter.matrix.known_tokens() > 0
    assert torch.equal(again.drafter.matrix.ids, first.drafter.matrix.ids)
    assert torch.equal(again.drafter.matrix.probs, first.drafter.matrix.probs)
    # The same state drafts the same trees: the same request accepts as much, and stays the target's.
    prompt = [4, 6, 8, 10]
    outs = [d.generate(input_ids=[prompt], max_new_tokens=12, temperature=0.0) for d in (first, again)]
    assert outs[0].token_ids == outs[1].token_ids == [greedy(folder, prompt, 12)]
    assert outs[0].stats.accepted_per_round == outs[1].stats.accepted_per_round
    assert sum(map(sum, outs[0].stats.accepted_per_round)) > 0

    for top_k in (4, 12):  # another width keeps the columns both have
        other = decoder(folder, {"name": "recycling", "memory_file": str(path), "top_k": top_k})
        k = min(top_k, 8)
        assert torch.equal(other.drafter.matrix.ids[:, :k], saved[:, :k])
        assert (other.drafter.matrix.ids[:, k:] == -1).all()


def test_a_restarted_suffix_drafter_drafts_from_the_saved_outputs(tiny_models, tmp_path):
    folder, path = tiny_models["llama"][0], tmp_path / "suffix.safetensors"
    first = decoder(folder, {"name": "suffix", "memory_file": str(path)})
    first.generate(input_ids=PROMPTS[:2], max_new_tokens=16, temperature=0.0)
    pieces = first.stream(input_ids=PROMPTS[2], max_new_tokens=16, temperature=0.0)
    next(pieces), next(pieces)  # a stream left half way: its row joins the cache when a call next
    pieces.close()  # begins, and is saved with it
    assert len(cached_rows(first.drafter)) == 2 and len(first.drafter.rows) == 1
    saved = cached_rows(first.drafter) + first.drafter.rows
    first.save_drafter_memory()

    again = decoder(folder, {"name": "suffix", "memory_file": str(path)})
    assert cached_rows(again.drafter) == saved
    out = again.generate(input_ids=[PROMPTS[0]], max_new_tokens=16, temperature=0.0)
    assert out.token_ids == [greedy(folder, PROMPTS[0], 16)]
    assert out.stats.drafter_report["from_cache"] > 0  # the answer before the restart is drafted again

    # What it learns after the restart is kept beside what it loaded (new rows, new sequence ids).
    again.generate(input_ids=[[7, 7, 3]], max_new_tokens=8, temperature=0.0)
    again.save_drafter_memory()
    third = decoder(folder, {"name": "suffix", "memory_file": str(path)})
    assert cached_rows(third.drafter)[:3] == saved and len(cached_rows(third.drafter)) == 5

    newest = decoder(folder, {"name": "suffix", "memory_file": str(path), "max_cached_requests": 2})
    assert cached_rows(newest.drafter) == cached_rows(third.drafter)[-2:]  # today's limits: the oldest leave
    rows = cached_rows(third.drafter)
    limit = len(rows[-1]) + len(rows[-2]) + len(rows[-3]) - 1  # the newest two fit, not three
    fewer = decoder(folder, {"name": "suffix", "memory_file": str(path), "max_cached_tokens": limit})
    assert cached_rows(fewer.drafter) == rows[-2:] and fewer.drafter.cache.tokens <= limit
    assert cached_rows(decoder(folder, {"name": "suffix", "memory_file": str(path),
                                        "max_cached_tokens": len(rows[-1]) - 1}).drafter) == []


def test_a_wrapped_drafter_saves_every_memory_it_holds(tiny_models, tmp_path):
    folder = tiny_models["llama"][0]
    files = [str(tmp_path / "s.safetensors"), str(tmp_path / "r.safetensors")]
    children = [{"name": "suffix", "memory_file": files[0]}, {"name": "ngram"},
                {"name": "recycling", "memory_file": files[1]}]
    dec = decoder(folder, {"name": "cascade", "adaptive": True, "drafters": children})
    dec.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=0.0)
    assert dec.drafter.memory_files() == files
    assert dec.save_drafter_memory() == files
    assert decoder(folder, {"name": "ngram"}).save_drafter_memory() == []
    with pytest.raises(ValueError, match="share memory_file"):  # each exit would overwrite the other's
        decoder(folder, {"name": "cascade", "drafters": [{"name": "suffix", "memory_file": files[0]},
                                                          {"name": "recycling", "memory_file": files[0]}]})


def test_a_save_that_fails_leaves_the_last_memory_whole(tiny_models, tmp_path, monkeypatch):
    folder, path = tiny_models["llama"][0], tmp_path / "r.safetensors"
    dec = decoder(folder, {"name": "recycling", "memory_file": str(path)})
    dec.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=0.0)
    dec.save_drafter_memory()
    before = path.read_bytes()

    def dies_half_way(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(memory_file, "save_file", dies_half_way)
    dec.generate(input_ids=[[11, 12, 13]], max_new_tokens=8, temperature=0.0)
    with pytest.raises(OSError, match="could not be written .*No space.* the last saved memory stands"):
        dec.save_drafter_memory()
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]  # no half file left beside it

    def interrupted(tensors, filename, metadata=None):  # Ctrl-C, or a second SIGTERM, half way
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(memory_file, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dec.save_drafter_memory()
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    monkeypatch.undo()
    assert decoder(folder, {"name": "recycling", "memory_file": str(path)}).drafter.matrix.known_tokens() > 0


def test_a_failed_save_names_its_cause_not_always_the_disk(tmp_path, monkeypatch):
    """Every failure advised "free some space", a lost race for the temporary file too."""
    path = tmp_path / "m.safetensors"
    for error, advice in ((OSError(errno.EACCES, "Permission denied"), "point memory_file at a writable path"),
                          (OSError(errno.ENOSPC, "No space left on device"), "free some space"),
                          (OSError(errno.ENOENT, "No such file or directory"), "save again")):
        def fails(tensors, filename, metadata=None, error=error):
            raise error
        monkeypatch.setattr(memory_file, "save_file", fails)
        with pytest.raises(OSError, match=f"could not be written .*{error.strerror}.*stands: {advice}") as caught:
            memory_file.write_memory(path, "suffix", {}, {"tokens": torch.zeros(2, dtype=torch.long)})
        assert ("free some space" in str(caught.value)) == (error.errno == errno.ENOSPC)
    assert not list(tmp_path.iterdir())


def test_two_processes_saving_one_memory_file_at_once_both_succeed(tmp_path, monkeypatch):
    """A generate and a serve sharing a memory file: while one writer was between its write and its
    rename, the other's save renamed their shared path + .tmp away, and the first failed."""
    path = tmp_path / "m.safetensors"
    first_written, second_saved = threading.Event(), threading.Event()
    save = memory_file.save_file

    def slow_first(tensors, filename, metadata=None):  # the first writer pauses before its rename
        save(tensors, filename, metadata=metadata)
        if threading.current_thread().name == "first":
            first_written.set()
            assert second_saved.wait(30)

    monkeypatch.setattr(memory_file, "save_file", slow_first)
    errors = []

    def first():
        try:
            memory_file.write_memory(path, "suffix", {}, {"tokens": torch.ones(3, dtype=torch.long)})
        except OSError as e:
            errors.append(e)

    writer = threading.Thread(target=first, name="first")
    writer.start()
    assert first_written.wait(30)
    memory_file.write_memory(path, "suffix", {}, {"tokens": torch.zeros(2, dtype=torch.long)})
    second_saved.set()
    writer.join(30)
    assert not errors, errors
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the last rename won; no temporary left


def test_a_memory_written_for_something_else_is_refused_and_kept(tiny_models, tmp_path):
    (llama, small_llama), qwen = tiny_models["llama"], tiny_models["qwen2"][0]
    matrix, cache = tmp_path / "r.safetensors", tmp_path / "s.safetensors"
    for name, path in (("recycling", matrix), ("suffix", cache)):
        dec = decoder(llama, {"name": name, "memory_file": str(path)})
        dec.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=0.0)
        dec.save_drafter_memory()
    written = {path: path.read_bytes() for path in (matrix, cache)}

    for other in (small_llama, qwen):  # another model's ranking
        with pytest.raises(ValueError, match="recycling: memory_file .* written for another target"):
            decoder(other, {"name": "recycling", "memory_file": str(matrix)})
    # Same tokenizer, another target: the cached outputs are still text in the same ids.
    assert len(cached_rows(decoder(small_llama, {"name": "suffix", "memory_file": str(cache)}).drafter)) == 3
    with pytest.raises(ValueError, match="suffix: memory_file .* written for another tokenizer"):
        decoder(qwen, {"name": "suffix", "memory_file": str(cache)})  # its tokenizer class splits digits apart
    with pytest.raises(ValueError, match="holds a 'suffix' drafter's memory, not a 'recycling' one"):
        decoder(llama, {"name": "recycling", "memory_file": str(cache)})
    assert {path: path.read_bytes() for path in (matrix, cache)} == written  # refused, not overwritten

    text, folder, other = tmp_path / "notes.txt", tmp_path / "folder", tmp_path / "other.safetensors"
    text.write_text("not a memory")
    folder.mkdir()
    save_file({"x": torch.zeros(2)}, str(other))
    old = tmp_path / "old.safetensors"
    save_file({"x": torch.zeros(2)}, str(old), metadata={"format": memory_file.FORMAT, "version": "0",
                                                         "drafter": "suffix", "identity": json.dumps({})})
    for path, message in ((text, "is not a drafter memory"), (folder, "is a directory"),
                          (other, "is a safetensors file but not a drafter memory"), (old, "format version 0")):
        with pytest.raises(ValueError, match=message) as caught:
            decoder(llama, {"name": "suffix", "memory_file": str(path)})
        assert "new path" in str(caught.value)  # the fix is named
    with pytest.raises(ValueError, match="max_cached_requests or max_cached_tokens is 0"):
        decoder(llama, {"name": "suffix", "memory_file": str(cache), "max_cached_requests": 0})


def test_a_damaged_memory_is_refused_before_it_drafts(tiny_models, tmp_path):
    """A corrupted or hand-made file with the right identity: a NaN probability would become a NaN
    q in the verifier, an id outside the vocabulary would crash the target pass. Refused at load."""
    folder = tiny_models["llama"][0]
    good = {}
    for name in ("recycling", "suffix"):
        dec = decoder(folder, {"name": name, "memory_file": str(tmp_path / f"{name}.safetensors")})
        dec.generate(input_ids=PROMPTS, max_new_tokens=8, temperature=0.0)
        dec.save_drafter_memory()
        good[name] = memory_file.read_memory(tmp_path / f"{name}.safetensors", name)
    vocab = decoder(folder, {"name": "none"}).engine.vocab_size

    def changed(name, **tensors):
        identity, saved = good[name]
        path = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.safetensors"  # a file of its own
        memory_file.write_memory(path, name, identity, {**saved, **tensors})
        return {"name": name, "memory_file": str(path)}

    probs, ids, tokens = (good["recycling"][1][k] for k in ("probs", "ids", "tokens"))
    lengths, cached = good["suffix"][1]["lengths"], good["suffix"][1]["tokens"]
    for config, why in ((changed("recycling", probs=torch.full_like(probs, float("nan"))), "probabilities outside"),
                        (changed("recycling", probs=probs + 1.5), "probabilities outside"),
                        (changed("recycling", ids=torch.full_like(ids, vocab)), "outside the target's vocabulary"),
                        (changed("recycling", tokens=tokens[:-1]), "shapes a matrix"),
                        (changed("suffix", tokens=torch.full_like(cached, vocab)), "outside the target's vocabulary"),
                        (changed("suffix", lengths=lengths + 1), "do not add up"),
                        (changed("suffix", lengths=lengths[:0]), "do not add up"),
                        # hand-made dtypes: float lengths crashed the split, float ids loaded and drafted nothing
                        (changed("suffix", lengths=lengths.float()), "float32 lengths, not integers"),
                        (changed("suffix", tokens=cached.double() + 0.5), "float64 tokens .* not integers"),
                        (changed("recycling", ids=ids.float()), "float32 ids .* not integer ids"),
                        (changed("recycling", tokens=tokens.float()), "float32 tokens, .* not integer ids"),
                        (changed("recycling", probs=(probs * 100).long()), "int64 probabilities")):
        with pytest.raises(ValueError, match=f"memory_file .* is damaged: it holds .*{why}"):
            decoder(folder, config)
    for name in ("recycling", "suffix"):  # the undamaged files still load
        assert decoder(folder, changed(name)).drafter.memory_files()


def test_the_cli_saves_the_memory_when_a_run_ends(tiny_models, chat_target, tmp_path, capsys, monkeypatch):
    folder, path = tiny_models["llama"][0], tmp_path / "cli" / "s.safetensors"
    args = ["generate", "--drafter", "suffix", "--set", f"target.path={folder}", "--set",
            f"drafter.memory_file={path}", "--input-ids", "3,4,5,6", "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    assert f"drafter memory saved to {path}" in capsys.readouterr().err
    assert main(args) == 0  # the second run loads the first's memory and adds its own
    assert len(cached_rows(decoder(folder, {"name": "suffix", "memory_file": str(path)}).drafter)) == 2

    chat = tmp_path / "chat.safetensors"
    monkeypatch.setattr(sys, "stdin", io.StringIO("def parse(text):\nand again\n"))
    assert main(["chat", "--drafter", "suffix", "--set", f"target.path={chat_target[0]}", "--set",
                 f"drafter.memory_file={chat}", "--max-new-tokens", "6", "--no-stats"]) == 0
    assert f"drafter memory saved to {chat}" in capsys.readouterr().err
    assert len(cached_rows(decoder(chat_target[0], {"name": "suffix", "memory_file": str(chat)}).drafter)) == 2


def test_a_server_saves_the_memory_between_batches_and_at_exit(tiny_models, tmp_path, capsys):
    folder, path = tiny_models["llama"][0], tmp_path / "r.safetensors"
    dec = decoder(folder, {"name": "recycling", "memory_file": str(path)})
    lock = threading.Lock()
    batcher = Batcher(dec, lock)
    batcher.generate([[3, 4, 5]], {"max_new_tokens": 6, "temperature": 0.0})
    time.sleep(0.5)
    assert not path.exists()  # save_memory_every None: only at exit
    batcher.save_memory_every = 0.0  # after every round and batch
    batcher.generate([[6, 7, 8]], {"max_new_tokens": 6, "temperature": 0.0})
    deadline = time.monotonic() + 30
    while batcher._runner and time.monotonic() < deadline:  # the last save comes after the answer
        time.sleep(0.05)
    assert path.exists()
    path.unlink()

    def fails():
        raise RuntimeError("the save broke")

    saves = dec.save_drafter_memory
    dec.save_drafter_memory = fails  # a save that fails is reported; the server goes on serving
    for prompt in ([3, 4], [5, 6]):
        deadline = time.monotonic() + 60
        out, _ = batcher.generate([prompt], {"max_new_tokens": 4, "temperature": 0.0},
                                  gone=lambda: time.monotonic() > deadline)
        assert len(out.token_ids[0]) == 4
    while batcher._runner and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "drafter memory not saved: the save broke" in capsys.readouterr().err
    dec.save_drafter_memory = saves

    with lock:  # a batch still runs: the exit save waits, then gives up and says so
        batcher.finish_at_exit(wait=0.2)
    assert not path.exists() and "a batch still ran after 0 s; drafter memory not saved" in capsys.readouterr().err
    batcher.finish_at_exit()
    assert decoder(folder, {"name": "recycling", "memory_file": str(path)}).drafter.matrix.known_tokens() > 0


def test_a_served_drafter_keeps_its_memory_when_the_server_is_stopped(tiny_models, tmp_path):
    """`draftsman serve` as a process: SIGTERM (docker stop, systemd) stops it as Ctrl-C does, and
    the drafter's memory is written on the way out, within a round of the request still running
    (docker stop kills after 10 s; a save that waited for the request would not come)."""
    folder, path = tiny_models["llama"][0], tmp_path / "served.safetensors"
    server, base = slow_serve_process("recycling:RecyclingDrafter", "--drafter", "recycling", "--set",
                                      f"target.path={folder}", "--set", f"drafter.memory_file={path}")
    try:
        status, answer = call(base, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
        assert not path.exists()  # the periodic save is due after 300 s
        long = {"prompt": "def g(y):", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        threading.Thread(target=lambda: call(base, "/v1/completions", long), daemon=True).start()
        deadline = time.monotonic() + 30
        while "num_requests_running 1.0" not in urllib.request.urlopen(base + "/metrics").read().decode():
            assert time.monotonic() < deadline, "the long request never ran"
            time.sleep(0.05)
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 8
        assert f"drafter memory saved to {path}" in server.stderr.read()
    finally:
        server.kill()
        server.stderr.close()
    assert decoder(folder, {"name": "recycling", "memory_file": str(path)}).drafter.matrix.known_tokens() > 0


def test_a_stopping_server_ends_its_batch_within_a_round_and_saves(tiny_models, tmp_path):
    """At exit the running rows end after their round (finish reason "abort") and waiting requests
    are refused, so the save does not wait for long generations (docker stop kills after 10 s)."""
    folder, path = tiny_models["llama"][0], tmp_path / "s.safetensors"
    dec = decoder(folder, {"name": "suffix", "memory_file": str(path)})
    propose = dec.drafter.propose

    def slow(contexts):  # a round of a big target: the long request would run for 10 s or more
        time.sleep(0.2)
        return propose(contexts)

    dec.drafter.propose = slow
    batcher = Batcher(dec, threading.Lock())
    answers = {}

    def ask(name, args):
        args = {"max_new_tokens": 240, "ignore_eos": True, "temperature": 0.0, **args}
        try:
            answers[name] = batcher.generate([[3, 4, 5]], args)[0]
        except Exception as e:  # noqa: BLE001
            answers[name] = e

    long = threading.Thread(target=ask, args=("long", {}))
    long.start()
    deadline = time.monotonic() + 30
    while not batcher.running and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = threading.Thread(target=ask, args=("waiting", {"seed": 1}))  # a seed runs alone: it waits
    waiting.start()
    while not batcher.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    batcher.stop()
    batcher.finish_at_exit(wait=30)
    assert time.monotonic() - t0 < 10 and path.exists()
    long.join(30), waiting.join(30)
    assert answers["long"].stats.finish_reasons == ["abort"] and len(answers["long"].token_ids[0]) < 240
    assert isinstance(answers["waiting"], ServerStopping)
    ask("late", {})
    assert isinstance(answers["late"], ServerStopping)  # after the stop nothing new runs
    assert len(cached_rows(decoder(folder, {"name": "suffix", "memory_file": str(path)}).drafter)) == 1


def test_a_stopped_server_answers_503(tiny_models):
    dec = decoder(tiny_models["llama"][0], {"name": "ngram"})
    with running(dec) as (server, base):
        server.batcher.stop()
        status, answer = call(base, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4})
    assert status == 503 and "the server is stopping" in answer["error"]["message"]


def test_a_server_saves_the_memory_while_one_generation_runs_on(tiny_models, tmp_path):
    """Under steady load requests keep joining one generation, which may then run for hours: the
    periodic save comes between its rounds, each file holding the running row's output so far."""
    folder, path = tiny_models["llama"][0], tmp_path / "running.safetensors"
    dec = decoder(folder, {"name": "suffix", "memory_file": str(path)})
    propose, save = dec.drafter.propose, dec.save_drafter_memory

    def slow(contexts):  # rounds of a big target
        time.sleep(0.05)
        return propose(contexts)

    saved_rows = []

    def saving():  # what each save wrote, as the next process would load it
        paths = save()
        saved_rows.append(cached_rows(decoder(folder, {"name": "suffix", "memory_file": str(path)}).drafter))
        return paths

    dec.drafter.propose, dec.save_drafter_memory = slow, saving
    batcher = Batcher(dec, threading.Lock())
    batcher.save_memory_every = 0.3
    prompt, n = [3, 4, 5], 48
    out, _ = batcher.generate([prompt], {"max_new_tokens": n, "temperature": 0.0})
    assert out.token_ids == [greedy(folder, prompt, n)]  # saving between rounds changes nothing
    whole = prompt + out.token_ids[0]
    during = [rows for rows in saved_rows if rows and len(rows[0]) < len(whole)]
    assert len(during) >= 2, saved_rows  # saves before the generation ended, its output growing
    assert all(len(rows) == 1 and whole[:len(rows[0])] == rows[0] for rows in during)
    assert len({len(rows[0]) for rows in during}) == len(during)
