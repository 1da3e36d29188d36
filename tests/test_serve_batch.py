"""`draftsman serve` batches the requests that wait while it generates: those with the same
settings run as one batch of at most --max-batch-rows rows, in arrival order; a seeded request
runs alone; one bad input in a batch fails only its own request. Every answer equals what the
request gets on its own."""
import threading
import time

import pytest

from draftsman import cli
from draftsman.serve_batch import Batcher
from draftsman.serve_metrics import ServeMetrics

from serving import NEW, events, ngram_decoder, queue_while_busy, running


@pytest.fixture(scope="module")
def server(chat_target):
    decoder = ngram_decoder(chat_target[0])
    with running(decoder, max_batch_rows=4) as (server, base):
        yield server, decoder, base


def test_waiting_requests_with_the_same_settings_run_together(server):
    server, decoder, base = server
    prompts = ["def parse(text):\n", "import os\nimport", "class Foo:\n", "x = [", "for i in range(", "if x:\n"]
    greedy = lambda p: {"prompt": p, "max_tokens": NEW}  # noqa: E731
    seeded = {"prompt": prompts[0], "max_tokens": NEW, "temperature": 1.0, "seed": 3}
    longer = {"prompt": [prompts[1], prompts[4]], "max_tokens": NEW + 3}
    bodies = [greedy(prompts[0]), greedy(prompts[1:3]), seeded, greedy(prompts[3]), seeded, longer,
              greedy(prompts[4]), greedy(prompts[5])]
    answers = queue_while_busy(server, base, bodies)
    assert all(status == 200 for status, _ in answers), answers
    texts = [[c["text"] for c in got["choices"]] for _, got in answers]
    for body, got in zip(bodies, texts):  # each answer is the request's own output
        settings = {k: v for k, v in body.items() if k != "prompt"}
        settings["max_new_tokens"] = settings.pop("max_tokens")
        p = body["prompt"]
        want = decoder.generate([p] if isinstance(p, str) else p, **settings)
        assert got == want.texts, body
        assert [c["finish_reason"] for c in answers[bodies.index(body)][1]["choices"]] == [
            {"eos": "stop", "length": "length"}[r] for r in want.stats.finish_reasons]
    # 1 + 2 + 1 rows fill the first batch (4); the seeded requests (alike, so their outputs are
    # equal) each run alone; the longer one (max_tokens may differ within a batch: a limit per
    # row) and the two greedy ones the full batch left waiting run together.
    assert [got["draftsman"]["batch_rows"] for _, got in answers] == [4, 4, 1, 4, 1, 4, 4, 4]
    assert [len(c) for c in texts] == [1, 2, 1, 1, 1, 2, 1, 1]


def test_each_request_gets_its_own_rows_logprobs(server):
    server, decoder, base = server
    bodies = [{"prompt": p, "max_tokens": NEW, "logprobs": 2, "stop": "W"}
              for p in ("def parse(text):\n", "x = [", "if x:\n")]
    answers = queue_while_busy(server, base, bodies)
    assert [got["draftsman"]["batch_rows"] for _, got in answers] == [3, 3, 3]
    reasons = []
    for body, (status, got) in zip(bodies, answers):
        want = decoder.generate([body["prompt"]], max_new_tokens=NEW, logprobs=True, top_logprobs=2, stop=["W"])
        assert got["choices"][0]["text"] == want.texts[0]
        reasons.append(got["choices"][0]["finish_reason"])
        assert reasons[-1] == {"stop": "stop", "eos": "stop", "length": "length"}[want.stats.finish_reasons[0]]
        scores = got["choices"][0]["logprobs"]
        assert scores["token_logprobs"] == pytest.approx(want.logprobs[0], abs=1e-4)
        # (keyed by text, two byte tokens may share "\ufffd": compare each position's likeliest)
        assert [max(top.values()) for top in scores["top_logprobs"]] == pytest.approx(
            [top[0][1] for top in want.top_logprobs[0]], abs=1e-4)
    assert sorted(set(reasons)) == ["length", "stop"]  # the rows ended differently: each reads its own


def test_one_bad_input_in_a_batch_fails_only_its_request(server):
    server, decoder, base = server
    too_long = {"prompt": [5] * 300, "max_tokens": NEW}  # the tiny target's context is 256
    bodies = [{"prompt": "def parse(text):\n", "max_tokens": NEW}, too_long, {"prompt": "x = [", "max_tokens": NEW}]
    answers = queue_while_busy(server, base, bodies)
    assert [status for status, _ in answers] == [200, 400, 200]
    assert "prompt 0 has 300 tokens but the target's context is 256" in answers[1][1]["error"]["message"]
    assert answers[0][1]["choices"][0]["text"] == decoder.generate(["def parse(text):\n"], max_new_tokens=NEW).texts[0]
    assert [answers[i][1]["draftsman"]["batch_rows"] for i in (0, 2)] == [1, 1]


def test_a_stream_waits_for_the_batch_that_is_generating(server):
    server, decoder, base = server
    answer = []
    body = {"prompt": "def parse(text):\n", "max_tokens": NEW, "stream": True}
    with server.generating:
        thread = threading.Thread(target=lambda: answer.append(events(base, "/v1/completions", body)))
        thread.start()
        thread.join(0.5)
        assert not answer, "a stream ran while another generation held the model"
    thread.join(60)
    text = "".join(e["choices"][0]["text"] for e in answer[0])
    assert text == decoder.generate(["def parse(text):\n"], max_new_tokens=NEW).texts[0]


def test_max_batch_rows_must_be_positive(capsys):
    assert cli.main(["serve", "--max-batch-rows", "0", "--port", "0"]) == 2  # before any model loads
    assert "--max-batch-rows must be >= 1" in capsys.readouterr().err
    assert cli.main(["serve", "--prefill-chunk", "-1", "--port", "0"]) == 2
    assert "--prefill-chunk must be >= 0 tokens (0: whole prompts), got -1" in capsys.readouterr().err


def test_a_port_in_use_or_out_of_range_and_a_bad_host_are_named_before_the_model_loads(capsys):
    """They were "[Errno 98] Address already in use", an OverflowError traceback and "[Errno -2]
    Name or service not known", each after the model had loaded. (No config: the target is never
    read, so a refusal here comes before it.)"""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, message in ((["--port", str(port)], f"port {port} on 127.0.0.1 is in use (another server?)"),
                              (["--port", "70000"], "--port must be in 0..65535 (0: any free port), got 70000"),
                              (["--port", "-1"], "--port must be in 0..65535"),
                              (["--host", "no-such-host.invalid", "--port", "0"], "--host 'no-such-host.invalid'"),
                              (["--host", "192.0.2.1", "--port", "0"], "cannot listen on 192.0.2.1:0")):
            assert cli.main(["serve", *argv]) == 2
            assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, chunk", [([], 256), (["--prefill-chunk", "32"], 32), (["--prefill-chunk", "0"], None)])
def test_serve_prefills_joining_prompts_in_chunks(monkeypatch, chat_target, flag, chunk):
    import draftsman.serve as S

    class Started(Exception):
        pass

    def caught(decoder, *args, **kwargs):
        assert decoder.engine.join_prefill_chunk == chunk
        raise Started
    monkeypatch.setattr(S, "Server", caught)
    with pytest.raises(Started):
        cli.main(["serve", "--drafter", "ngram", "--set", f"target.path={chat_target[0]}", "--port", "0", *flag])


def test_streams_and_other_requests_that_wait_together_run_as_one_batch(server):
    server, decoder, base = server
    stream = lambda p, **more: {"prompt": p, "max_tokens": NEW, "stream": True, **more}  # noqa: E731
    bodies = [stream("def parse(text):\n"), stream("x = ["), {"prompt": "if x:\n", "max_tokens": NEW},
              stream("import os\nimport", logprobs=1), stream("if x:\n"), stream("class Foo:\n", seed=2,
                                                                                   temperature=1.0)]
    answers = queue_while_busy(server, base, bodies)
    assert [status for status, _ in answers] == [200] * 6
    for body, (_, got) in zip(bodies, answers):
        settings = {k: v for k, v in body.items() if k not in ("prompt", "stream", "max_tokens", "logprobs")}
        want = decoder.generate([body["prompt"]], max_new_tokens=NEW, **settings)
        if body.get("stream"):
            assert "".join(e["choices"][0]["text"] for e in got) == want.texts[0], body
            assert got[-1]["choices"][0]["finish_reason"] == {"eos": "stop", "length": "length"}[
                want.stats.finish_reasons[0]]
        else:
            assert got["choices"][0]["text"] == want.texts[0]
    rows = [got[-1]["draftsman"]["batch_rows"] if body.get("stream") else got["draftsman"]["batch_rows"]
            for body, (_, got) in zip(bodies, answers)]
    # Requests with the same settings share a batch, streamed or not, the one asking for logprobs
    # too (four of them: the cap is 4 rows, so the fifth runs after them); the seeded one alone.
    assert rows == [4, 4, 4, 4, 1, 1]
    scored = [e["choices"][0]["logprobs"] for e in answers[3][1] if e["choices"][0]["logprobs"]]
    want = decoder.generate(["import os\nimport"], max_new_tokens=NEW, logprobs=True)
    assert [v for s in scored for v in s["token_logprobs"]] == pytest.approx(want.logprobs[0], abs=1e-5)


def test_a_bad_stream_in_a_batch_fails_only_its_request(server):
    server, decoder, base = server
    bodies = [{"prompt": "x = [", "max_tokens": NEW, "stream": True},
              {"prompt": [5] * 300, "max_tokens": NEW, "stream": True},
              {"prompt": "if x:\n", "max_tokens": NEW, "stream": True}]
    answers = queue_while_busy(server, base, bodies)
    assert [status for status, _ in answers] == [200, 400, 200]
    assert "prompt 0 has 300 tokens" in answers[1][1]["error"]["message"]
    assert "".join(e["choices"][0]["text"] for e in answers[2][1]) == decoder.generate(
        ["if x:\n"], max_new_tokens=NEW).texts[0]
    assert answers[0][1][-1]["draftsman"]["batch_rows"] == 1  # rerun alone after the batch's input check failed


def test_an_error_mid_stream_ends_it_with_an_error_event(server, monkeypatch):
    server, decoder, base = server
    stream_batch = decoder.stream_batch

    def failing(*args, **kwargs):
        for n, item in enumerate(stream_batch(*args, **kwargs)):
            if n == 2:
                raise RuntimeError("out of memory (simulated)")
            yield item

    monkeypatch.setattr(decoder, "stream_batch", failing)
    got = events(base, "/v1/completions", {"prompt": "x = [", "max_tokens": NEW, "stream": True})
    assert got[-1]["error"]["message"] == "generation failed: out of memory (simulated)"
    assert got[-1]["error"]["code"] == 500 and all("choices" in e for e in got[:-1]) and len(got) == 3
    monkeypatch.undo()
    again = events(base, "/v1/completions", {"prompt": "x = [", "max_tokens": NEW, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in again) == decoder.generate(["x = ["], max_new_tokens=NEW).texts[0]


def test_a_stream_that_ends_early_does_not_wait_for_its_batch():
    import threading as t

    from draftsman.api import StreamChunk

    release = t.Event()

    class FakeDecoder:  # row 0 ends at once; row 1 ends only when the test says so
        can_join = False  # rows joining a running batch: tests/test_continuous_batching.py
        config = {"sampling": {}, "generation": {}}  # no defaults: a request's settings are as sent
        def stream_batch(self, rows, stats, **settings):
            stats.finish_reasons = ["", ""]
            yield 0, StreamChunk("a", [1])
            stats.finish_reasons[0] = "stop"
            yield 0, StreamChunk("", [], finish_reason="stop")
            assert release.wait(10), "the test never let row 1 end"
            yield 1, StreamChunk("b", [2])
            stats.finish_reasons[1] = "length"
            yield 1, StreamChunk("", [], finish_reason="length")

    lock = t.Lock()
    batcher = Batcher(FakeDecoder(), lock)
    with lock:  # as if another batch were generating: both wait, then run as one batch
        job0, chunks0 = batcher.stream([[5]], {})
        job1, chunks1 = batcher.stream([[6]], {})
    got0 = []
    reader = t.Thread(target=lambda: got0.extend(chunk for _, chunk in chunks0))
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "the early stream waited for its batch to end"
    assert [c.text for c in got0] == ["a", ""] and job0.stats.finish_reasons == ["stop"] and job0.batch_rows == 2
    release.set()
    assert [c.text for _, c in chunks1] == ["b", ""] and job1.stats.finish_reasons == ["length"]


def test_a_request_that_ends_early_is_answered_before_its_batch_ends():
    """Not streamed: answered as soon as its rows have ended, its output joined from its chunks."""
    import threading as t

    from draftsman.api import StreamChunk
    from draftsman.serve_batch import Batcher

    release = t.Event()

    class FakeDecoder:  # rows 0-1 (the first request, n = 2) end at once; row 2 when the test says so
        can_join = False  # rows joining a running batch: tests/test_continuous_batching.py
        config = {"sampling": {}, "generation": {}}  # no defaults: a request's settings are as sent
        def check_join(self, *args, **kwargs):  # every request is valid here
            pass

        def stream_batch(self, rows, stats, **settings):
            assert rows == [[5], [5], [6], [6]] and "num_return_sequences" not in settings  # n rows of each prompt
            stats.finish_reasons = ["", "", "", ""]
            yield 0, StreamChunk("a", [1], [-0.5], None)
            yield 1, StreamChunk("b", [2], [-0.25], None)
            yield 0, StreamChunk("c", [3], [-1.0], None)
            stats.finish_reasons[:2] = ["stop", "length"]
            yield 0, StreamChunk("", [], [], None, finish_reason="stop")
            yield 1, StreamChunk("", [], [], None, finish_reason="length")
            assert release.wait(10), "the test never let the second request's rows end"
            for row in (2, 3):
                yield row, StreamChunk("d", [4], [-2.0], None)
                stats.finish_reasons[row] = "eos"
                yield row, StreamChunk("", [], [], None, finish_reason="eos")

    lock = t.Lock()
    batcher = Batcher(FakeDecoder(), lock)
    answers = {}
    args = {"num_return_sequences": 2, "logprobs": True}
    threads = [t.Thread(target=lambda i=i: answers.update({i: batcher.generate([[5 + i]], args)})) for i in (0, 1)]
    with lock:  # as if another batch were generating: both wait, then run as one batch
        for i, thread in enumerate(threads):
            thread.start()
            while len(batcher.waiting) < i + 1:  # in this order: the first request's rows come first
                t.Event().wait(0.01)
    threads[0].join(5)
    assert not threads[0].is_alive(), "the early request waited for its batch to end"
    out, batch_rows = answers[0]
    assert (out.texts, out.token_ids, out.logprobs) == (["ac", "b"], [[1, 3], [2]], [[-0.5, -1.0], [-0.25]])
    assert out.top_logprobs is None and out.stats.finish_reasons == ["stop", "length"] and batch_rows == 4
    release.set()
    threads[1].join(5)
    assert answers[1][0].texts == ["d", "d"] and answers[1][0].stats.finish_reasons == ["eos", "eos"]


def test_requests_with_different_n_share_a_batch(server):
    server, decoder, base = server
    body = {"prompt": "x = [", "max_tokens": NEW, "temperature": 1.0}
    answers = queue_while_busy(server, base, [{**body, "n": 2}, body, {**body, "n": 2}])
    assert [status for status, _ in answers] == [200] * 3
    assert [len(got["choices"]) for _, got in answers] == [2, 1, 2]
    # The first two share a batch (3 rows); the third's 2 rows would pass the cap of 4: it joins
    # when one of their rows has ended (beside 2 rows: 4), or runs after them (2).
    rows = [got["draftsman"]["batch_rows"] for _, got in answers]
    assert rows[:2] == [3, 3] and rows[2] in (2, 4), rows


def test_a_requests_statistics_are_a_snapshot_the_batch_does_not_change():
    from draftsman.api import GenerationStats
    from draftsman.serve_batch import _snapshot

    stats = GenerationStats(new_tokens=5, accepted_per_round=[[1, 2], [0]], proposed_at_depth=[2, 1],
                            accepted_at_depth=[1, 1], finish_reasons=["eos", ""], drafter_report={"used": 1})
    snap = _snapshot(stats, ["eos"])
    stats.new_tokens += 3  # the batch goes on
    stats.accepted_per_round[1].append(2)
    stats.proposed_at_depth[0] += 1
    stats.accepted_at_depth.append(1)
    stats.finish_reasons[1] = "length"
    stats.drafter_report["used"] = 2
    assert (snap.new_tokens, snap.accepted_per_round, snap.proposed_at_depth, snap.accepted_at_depth) == (
        5, [[1, 2], [0]], [2, 1], [1, 1])
    assert snap.finish_reasons == ["eos"] and snap.drafter_report == {"used": 1}


def test_requests_that_differ_in_logprobs_share_a_batch(chat_target):
    """logprobs and top_logprobs keep no request apart: the batch scores every row with as many
    top tokens as its requests ask at most, and each request gets what it asked for (the scores
    it gets alone); a request that asks for more top tokens than a running batch records waits
    for the next one."""
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, hold_until_joined, slowed
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    long_job, chunks = batcher.stream(decoder.encode(SERVE_PROMPTS[:1]), {"max_new_tokens": 60, "min_new_tokens": 60,
                                                                         "logprobs": True, "top_logprobs": 3})
    got = [next(chunks)[1]]
    hold_until_joined(batcher, decoder, long_job, joins=2)  # the plain request's and the fewer one's
    ids = decoder.encode(SERVE_PROMPTS[1:2])
    plain, plain_rows = batcher.generate(ids, {"max_new_tokens": 8})
    fewer, fewer_rows = batcher.generate(ids, {"max_new_tokens": 8, "logprobs": True, "top_logprobs": 1})
    assert plain_rows == fewer_rows == 2 and long_job.stats is None  # both ran beside the long row
    more, more_rows = batcher.generate(ids, {"max_new_tokens": 8, "logprobs": True, "top_logprobs": 5})
    assert more_rows == 1  # it waited for the long row's batch to end
    got += [chunk for _, chunk in chunks]
    alone = decoder.generate(SERVE_PROMPTS[1:2], max_new_tokens=8, logprobs=True, top_logprobs=5)
    assert plain.logprobs is None and plain.top_logprobs is None and plain.token_ids == alone.token_ids
    for out, top in ((fewer, 1), (more, 5)):
        assert out.token_ids == alone.token_ids
        assert out.logprobs[0] == pytest.approx(alone.logprobs[0], abs=1e-4)
        assert [[t for t, _ in entry] for entry in out.top_logprobs[0]] == \
            [[t for t, _ in entry[:top]] for entry in alone.top_logprobs[0]]
    assert all(len(entry) == 3 for c in got for entry in c.top_logprobs)  # the long stream's own 3


def test_requests_with_other_n_share_a_batch(chat_target):
    """n keeps no request apart: a request's prompt runs n times beside the others' (prefilled
    once), joining a running batch too, and it gets n samples; n 2 at temperature 0 is refused
    alone (identical rows), and the batch goes on."""
    from draftsman.serve_batch import Batcher

    from test_continuous_batching import SERVE_PROMPTS, slowed, start_long_stream
    from serving import ngram_decoder

    decoder = slowed(ngram_decoder(chat_target[0]))
    batcher = Batcher(decoder, threading.Lock(), max_rows=6)
    long_job, chunks, got = start_long_stream(batcher, decoder)
    ids = decoder.encode(SERVE_PROMPTS[1:3])
    # top_k 1 at T=1: sampling that draws the argmax, so each sample is its prompt's greedy output
    sampled, rows = batcher.generate(ids, {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 1.0,
                                           "top_k": 1, "num_return_sequences": 2})
    assert rows == 5 and long_job.stats is None  # its 4 rows ran beside the long one
    with pytest.raises(ValueError, match="num_return_sequences=2 at temperature 0 would give identical rows"):
        batcher.generate(ids[:1], {"max_new_tokens": 8, "num_return_sequences": 2})
    got += [chunk for _, chunk in chunks]  # (the decoder is the batch's until it ends)
    greedy = decoder.generate(SERVE_PROMPTS[1:3], max_new_tokens=8, min_new_tokens=8).token_ids
    assert sampled.token_ids == [greedy[0], greedy[0], greedy[1], greedy[1]]  # prompt by prompt, n each
    # The same as a batch of its own (no batch running now), and n 2 at temperature 0 refused there too.
    again, rows = batcher.generate(ids, {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 1.0,
                                         "top_k": 1, "num_return_sequences": 2})
    assert rows == 4 and again.token_ids == sampled.token_ids
    with pytest.raises(ValueError, match="num_return_sequences=2 at temperature 0 would give identical rows"):
        batcher.generate(ids, {"max_new_tokens": 8, "num_return_sequences": 2})
    alone = decoder.generate(SERVE_PROMPTS[:1], max_new_tokens=60, min_new_tokens=60)
    assert [t for c in got for t in c.token_ids] == alone.token_ids[0]


def test_a_request_is_counted_in_the_metrics_before_it_is_answered(chat_target):
    """A client that reads /metrics as soon as it has its answer sees its own request, counted
    and no longer running: the generating thread records before it answers. Here recording is
    slow, so were the order the other way round the counters would still be empty (and the
    request running) when generate returns."""
    decoder = ngram_decoder(chat_target[0])
    metrics = ServeMetrics("tiny", "ngram")

    def slow_record(*args, **kwargs):
        time.sleep(0.3)
        metrics.record(*args, **kwargs)

    batcher = Batcher(decoder, threading.Lock(), record=slow_record)
    out, _ = batcher.generate(decoder.encode(["def parse(text):\n"]), {"max_new_tokens": NEW})
    sample = lambda name, **labels: metrics.registry.get_sample_value(f"draftsman:{name}", labels)  # noqa: E731
    assert batcher.running == 0 and sample("batches_total") == 1
    assert sample("generation_tokens_total") == len(out.token_ids[0]) > 0
    reason = {"eos": "stop", "length": "length"}[out.stats.finish_reasons[0]]
    assert sample("request_success_total", finished_reason=reason) == 1


def test_work_on_the_models_runs_between_rounds_of_a_running_generation():
    """An echo's prompt scoring took the models' lock, which a generation holds until it ends; under
    a steady load requests keep joining it, so the scoring waited for the load to stop (18 s behind
    three looping clients). with_models runs it between two rounds."""
    from draftsman.api import StreamChunk

    release, rounds = threading.Event(), []

    class EndlessDecoder:  # one row that generates until the test lets it end
        can_join = False
        config = {"sampling": {}, "generation": {}}

        def stream_batch(self, rows, stats, **settings):
            stats.finish_reasons = [""]
            while not release.is_set():
                rounds.append(time.monotonic())
                time.sleep(0.01)
                yield 0, StreamChunk("a", [1])
            stats.finish_reasons = ["length"]
            yield 0, StreamChunk("", [], finish_reason="length")

    batcher = Batcher(EndlessDecoder(), threading.Lock())
    _, chunks = batcher.stream([[5]], {})
    reader = threading.Thread(target=lambda: list(chunks))
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not rounds:
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.01)
        got = []
        scorer = threading.Thread(target=lambda: got.append(batcher.with_models(lambda: "scored")))
        scorer.start()
        scorer.join(10)
        assert got == ["scored"], "the work waited for the generation to end"
        assert not release.is_set() and batcher.lock.locked()  # while the generation still runs
        with pytest.raises(ZeroDivisionError):  # the work's error is raised in the caller's thread
            batcher.with_models(lambda: 1 / 0)
    finally:
        release.set()
        reader.join(10)
    assert batcher.with_models(lambda: "alone") == "alone"  # no generation: it runs in the caller


def test_scoring_between_rounds_leaves_the_generation_exactly_as_alone(chat_target):
    """with_models runs a target pass in the middle of a generation: the generation's tokens and the
    scores must both be what each gives alone (the pass may not touch the generation's state)."""
    decoder = ngram_decoder(chat_target[0])
    prompt, other = decoder.encode(["def parse(text):\n"])[0], decoder.encode(["import os\nimport"])[0]
    args = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0.0}
    alone = decoder.generate(input_ids=[prompt], **args).token_ids[0]
    scores_alone = decoder.prompt_logprobs([other])[0]
    batcher = Batcher(decoder, threading.Lock())
    out = []
    generation = threading.Thread(target=lambda: out.append(batcher.generate([prompt], dict(args))[0]))
    generation.start()
    mid_run = 0
    while generation.is_alive():
        scores = batcher.with_models(lambda: decoder.prompt_logprobs([other])[0])
        assert scores[0][0] is None and scores[0][1:] == pytest.approx(scores_alone[0][1:], abs=1e-6)
        mid_run += batcher.running > 0
    generation.join()
    assert mid_run > 0, "no scoring ran while the generation did"
    assert out[0].token_ids[0] == alone
