"""Decoder.stream_chunks: per round the newly visible text, the new token ids and their scores.
Joined, they equal generate's text, token_ids, logprobs and top_logprobs, with a stop string
holding text back too; stream() yields the same text pieces. The server streams the same scores."""
import json
import threading
import urllib.request

import pytest

import draftsman
from draftsman.serve import Server

NEW = 24
PROMPT = "def parse(text):\n"


@pytest.fixture(scope="module")
def decoder(tiny_models):
    target, _ = tiny_models["llama"]
    return draftsman.load({"target": {"path": str(target)},
                           "drafter": {"name": "ngram", "k": 3, "branches": 2, "min_ngram": 1}})


def joined(chunks):
    out = {"text": "", "token_ids": [], "logprobs": [], "top_logprobs": []}
    for c in chunks:
        out["text"] += c.text
        out["token_ids"] += c.token_ids
        out["logprobs"] += c.logprobs or []
        out["top_logprobs"] += c.top_logprobs or []
    return out


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8, "top_k": 30, "seed": 4}], ids=["greedy", "sampled"])
def test_chunks_join_to_generates_output(decoder, settings):
    want = decoder.generate(PROMPT, max_new_tokens=NEW, logprobs=True, top_logprobs=3, **settings)
    chunks = list(decoder.stream_chunks(PROMPT, max_new_tokens=NEW, logprobs=True, top_logprobs=3, **settings))
    got = joined(chunks)
    assert got["text"] == want.texts[0] and got["token_ids"] == want.token_ids[0]
    assert got["logprobs"] == want.logprobs[0] and got["top_logprobs"] == want.top_logprobs[0]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    plain = list(decoder.stream_chunks(PROMPT, max_new_tokens=NEW, **settings))
    assert all(c.logprobs is None and c.top_logprobs is None for c in plain)
    assert [c.text for c in plain if c.text] == list(decoder.stream(PROMPT, max_new_tokens=NEW, **settings))


def test_a_stop_string_holds_text_back_but_not_tokens(decoder):
    text = decoder.generate(PROMPT, max_new_tokens=NEW).texts[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    want = decoder.generate(PROMPT, max_new_tokens=NEW, stop=[stop], logprobs=True)
    got = joined(decoder.stream_chunks(PROMPT, max_new_tokens=NEW, stop=[stop], logprobs=True))
    assert got["text"] == want.texts[0] and stop not in got["text"]
    assert got["token_ids"] == want.token_ids[0] and got["logprobs"] == want.logprobs[0]


def test_the_server_streams_the_same_scores(decoder):
    server = Server(decoder, "tiny", "127.0.0.1", 0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        def post(body):
            request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode())
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.read().decode()

        whole = json.loads(post({"prompt": PROMPT, "max_tokens": NEW, "logprobs": 2}))["choices"][0]["logprobs"]
        events = [json.loads(line[len("data: "):]) for line in post({"prompt": PROMPT, "max_tokens": NEW, "logprobs": 2,
                                                                     "stream": True}).splitlines()
                  if line.startswith("data: {")]
        scored = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for s in scored for x in s[key]] == whole[key], key
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.8, "top_k": 30, "seed": 4}], ids=["greedy", "sampled"])
def test_stream_batch_rows_join_to_generates_rows(decoder, settings):
    prompts = [PROMPT, "import os\nimport", "class Foo:\n    def"]
    ids = decoder.encode(prompts)
    first = decoder.generate(PROMPT, max_new_tokens=NEW).texts[0]
    at = next(i for i in range(len(first) // 2, len(first)) if "\ufffd" not in first[i:i + 2])
    stop = first[at:at + 2]  # ends greedy row 0 early, and holds text back
    want = decoder.generate(input_ids=ids, max_new_tokens=NEW, stop=[stop], logprobs=True, top_logprobs=2, **settings)
    stats = draftsman.GenerationStats()
    chunks = list(decoder.stream_batch(ids, stats=stats, max_new_tokens=NEW, stop=[stop], logprobs=True,
                                       top_logprobs=2, **settings))
    for row in range(len(prompts)):
        got = joined(c for r, c in chunks if r == row)
        assert got["text"] == want.texts[row] and got["token_ids"] == want.token_ids[row]
        assert got["logprobs"] == want.logprobs[row] and got["top_logprobs"] == want.top_logprobs[row]
    if not settings:
        assert want.stats.finish_reasons[0] == "stop"
    # rows are interleaved round by round, not one after another
    order = [r for r, c in chunks if c.token_ids]
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)
    assert stats.finish_reasons == want.stats.finish_reasons and stats.new_tokens == want.stats.new_tokens
    # each row ends with one chunk that says why, as soon as the row ends
    for row in range(len(prompts)):
        mine = [c for r, c in chunks if r == row]
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [want.stats.finish_reasons[row]]
        assert mine[-1].token_ids == []
    if not settings:  # row 0 stopped early: its end comes before the other rows' last tokens
        ends = [i for i, (r, c) in enumerate(chunks) if c.finish_reason]
        assert ends[0] == next(i for i, (r, c) in enumerate(chunks) if r == 0 and c.finish_reason)
        assert ends[0] < max(i for i, (r, c) in enumerate(chunks) if r != 0 and c.token_ids)
    with pytest.raises(TypeError, match=r"unknown settings \['temprature'\]"):
        next(decoder.stream_batch(ids, temprature=0.5))


@pytest.mark.parametrize("ending", ["length", "stop", "abort"])
def test_a_rows_last_chunk_comes_in_the_round_it_ends(decoder, monkeypatch, ending):
    """A row's last chunk comes before the next round is drafted, with `stats` counting the round
    it ended in: serve answers a request as its rows end, not a round later (when a long row
    beside it may hold the batch a while)."""
    ids = decoder.encode([PROMPT, "import os\nimport"])
    free = decoder.generate(input_ids=ids[:1], max_new_tokens=NEW).texts[0]
    settings = {"max_new_tokens": [5 if ending == "length" else NEW, NEW]}
    if ending == "stop":
        at = next(i for i in range(4, len(free)) if "\ufffd" not in free[i:i + 2])
        settings["stop"] = [[free[at:at + 2]], None]
    drafts = []
    propose = decoder.engine.drafter.propose
    monkeypatch.setattr(decoder.engine.drafter, "propose", lambda contexts: drafts.append(len(contexts))
                        or propose(contexts))
    stats, aborted = draftsman.GenerationStats(), set()
    for row, chunk in decoder.stream_batch(ids, stats=stats, aborted=aborted, **settings):
        if ending == "abort" and row == 0:
            aborted.add(0)  # it ends after the round it is in
        if row == 0 and chunk.finish_reason:
            assert chunk.finish_reason == ending
            assert len(drafts) == stats.rounds  # no round drafted since the one it ended in...
            assert drafts[-1] == 2  # ...which drafted for it too
            assert stats.row_rounds == 2 * stats.rounds and len(stats.accepted_per_round[0]) == stats.rounds
    assert stats.finish_reasons == [ending, "length"] and drafts[-1] == 1  # row 1 went on alone
