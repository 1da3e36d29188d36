"""Ending rows early: Decoder.stream_batch's `aborted` rows leave the batch after the round they
are in (finish reason "abort") while the other rows go on unchanged, and `draftsman serve`
stops generating for a client that disconnects: a stream, a request mid-generation, or one
still waiting for its batch."""
import json
import socket
import threading
import time

import pytest

from draftsman.serve_batch import Batcher

from serving import call, ngram_decoder, running, scrape

PROMPTS = ["def parse(text):\n", "x = ["]
LONG = 40  # with min_new_tokens = LONG: no row ends at EOS first


@pytest.fixture(scope="module")
def decoder(chat_target):
    return ngram_decoder(chat_target[0])


def read_rows(decoder, prompts, aborted, abort_at=None, **settings):
    """Each row's chunks; abort_at=(row, n): add `row` to `aborted` once it has n tokens."""
    chunks = {row: [] for row in range(len(prompts))}
    for row, chunk in decoder.stream_batch(decoder.encode(prompts), aborted=aborted, **settings):
        chunks[row].append(chunk)
        if abort_at is not None and row == abort_at[0] and sum(len(c.token_ids) for c in chunks[row]) >= abort_at[1]:
            aborted.add(row)
    return chunks


def test_an_aborted_row_ends_after_its_round_and_the_others_go_on(decoder):
    want = decoder.generate(PROMPTS, max_new_tokens=LONG, min_new_tokens=LONG)
    chunks = read_rows(decoder, PROMPTS, set(), abort_at=(1, 1), max_new_tokens=LONG, min_new_tokens=LONG)
    ended = [c.finish_reason for row in (0, 1) for c in chunks[row] if c.finish_reason]
    assert ended == ["length", "abort"]
    tokens = [[t for c in chunks[row] for t in c.token_ids] for row in (0, 1)]
    assert tokens[0] == want.token_ids[0]  # the other row is what it would have been
    # The aborted row: what it had when it was aborted plus at most the round then running
    # (the engine had already decided that round's end when the reader saw the tokens).
    assert tokens[1] == want.token_ids[1][:len(tokens[1])]
    rounds_read = sum(1 for c in chunks[1] if c.token_ids)
    assert 1 <= rounds_read <= 2 and len(tokens[1]) < LONG
    assert "".join(c.text for c in chunks[1]) == decoder.decode(tokens[1])


def test_rows_aborted_before_the_start_take_one_round(decoder):
    stats_rows = read_rows(decoder, PROMPTS, {0, 1}, max_new_tokens=LONG, min_new_tokens=LONG)
    for row in (0, 1):
        assert sum(1 for c in stats_rows[row] if c.token_ids) == 1
        assert stats_rows[row][-1].finish_reason == "abort"


def slow(decoder, seconds: float):
    """Each drafting step sleeps: a long generation stays running while the test acts."""
    propose = decoder.engine.drafter.propose

    def slowed(contexts):
        time.sleep(seconds)
        return propose(contexts)
    decoder.engine.drafter.propose = slowed


def test_a_stream_whose_client_disconnects_stops_generating(chat_target):
    decoder = ngram_decoder(chat_target[0])
    slow(decoder, 0.02)  # 200 tokens would take seconds
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "min_tokens": 200, "stream": True}).encode()
    with running(decoder) as (server, base):
        client = raw_post(server, body)
        received = b""
        while b"data:" not in received:
            received += client.recv(4096)
        assert not server.generating.acquire(blocking=False), "a batch generates without holding the model"
        client.close()  # gone after the first event
        metrics = after_generation(server, base)
    assert metrics[("draftsman:request_success_total", (("finished_reason", "abort"),))] == 1
    assert metrics[("draftsman:generation_tokens_total", ())] < 100  # of the 200 asked for


def raw_post(server, body: bytes) -> socket.socket:
    """A client that sent POST /v1/completions and may leave without reading the answer."""
    client = socket.create_connection(server.server_address[:2], timeout=30)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return client


def after_generation(server, base: str) -> dict:
    """The metrics once no batch runs and none is about to (nothing left waiting)."""
    deadline = time.time() + 30
    while server.batcher.running or server.batcher.waiting or not server.generating.acquire(timeout=0.05):
        assert time.time() < deadline, "the server kept generating after its client left"
        time.sleep(0.02)
    server.generating.release()
    return scrape(base)


def test_a_request_whose_client_leaves_mid_generation_stops_generating(chat_target):
    """Not streamed: nothing is written until the answer, so the server watches the socket."""
    decoder = ngram_decoder(chat_target[0])
    slow(decoder, 0.02)
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 200, "min_tokens": 200}).encode()
    with running(decoder) as (server, base):
        client = raw_post(server, body)
        deadline = time.time() + 30
        while not server.batcher.running:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.01)
        time.sleep(0.1)
        client.close()
        metrics = after_generation(server, base)
    assert metrics[("draftsman:request_success_total", (("finished_reason", "abort"),))] == 1
    assert metrics[("draftsman:generation_tokens_total", ())] < 100  # of the 200 asked for
    assert metrics.get(("draftsman:e2e_request_latency_seconds_count", ()), 0) == 1  # answered, to nobody


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_waiting_request_whose_client_leaves_never_runs(chat_target, stream):
    decoder = ngram_decoder(chat_target[0])
    with running(decoder) as (server, base):
        with server.generating:  # busy: the request waits
            client = raw_post(server, json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "stream": stream}).encode())
            deadline = time.time() + 30
            while not server.batcher.waiting:
                assert time.time() < deadline, "the request never reached the queue"
                time.sleep(0.01)
            client.close()
            while server.batcher.waiting:
                assert time.time() < deadline, "a request whose client left stayed in the queue"
                time.sleep(0.01)
        metrics = after_generation(server, base)
        assert metrics.get(("draftsman:batches_total", ()), 0) == 0  # it never ran
        status, _ = call(base, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8})
        assert status == 200  # and the server goes on serving


def test_a_stream_cancelled_before_its_batch_runs_takes_one_round(decoder):
    lock = threading.Lock()
    batcher = Batcher(decoder, lock)
    args = {"max_new_tokens": LONG, "min_new_tokens": LONG}
    with lock:  # as if another batch were generating: both wait, then run as one batch
        job, chunks = batcher.stream(decoder.encode(PROMPTS[:1]), args)
        other, other_chunks = batcher.stream(decoder.encode(PROMPTS[1:]), args)
        job.cancel()  # before its batch starts
    mine = [chunk for _, chunk in chunks]
    assert sum(1 for c in mine if c.token_ids) == 1 and job.stats.finish_reasons == ["abort"]
    theirs = [chunk for _, chunk in other_chunks]  # ran in the same batch, to its end
    assert other.batch_rows == 2 and other.stats.finish_reasons == ["length"]
    assert [t for c in theirs for t in c.token_ids] == decoder.generate(PROMPTS[1:], **args).token_ids[0]


class _DropsOnFirstRelease:
    """The batcher's queue lock, which drops `job` (as its leaving client's handler would) right
    after the runner thread first lets go of it: the interleaving in which a runner that checked
    the queue and then took from it found it empty, died, and left every later request waiting."""

    def __init__(self, batcher, job_box: list):
        self.lock, self.batcher, self.job_box = threading.Lock(), batcher, job_box

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if self.job_box and threading.current_thread() is not threading.main_thread():
            self.batcher.drop(self.job_box.pop())


def test_a_client_leaving_as_the_runner_takes_its_job_loses_nothing(decoder):
    lock = threading.Lock()
    batcher = Batcher(decoder, lock)
    job_box = []
    batcher._waiting_lock = _DropsOnFirstRelease(batcher, job_box)
    args = {"max_new_tokens": LONG, "min_new_tokens": LONG}
    with lock:  # the runner waits for the lock; the job is queued
        job, chunks = batcher.stream(decoder.encode(PROMPTS[:1]), args)
        job_box.append(job)
    mine, read = [], threading.Event()  # read in a thread: a job that never runs never ends
    threading.Thread(target=lambda: (mine.extend(chunk for _, chunk in chunks), read.set()), daemon=True).start()
    assert read.wait(60), "a job taken by the runner never ran"
    assert not job_box and job.stats.finish_reasons == ["abort"] and mine  # cancelled after its first round
    answered = threading.Event()
    threading.Thread(target=lambda: (batcher.generate(decoder.encode(PROMPTS[1:]), {"max_new_tokens": 4}),
                                     answered.set()), daemon=True).start()
    assert answered.wait(60), "the runner died: a later request was never served"
