"""`GET /metrics` of `draftsman serve`: Prometheus counters named as vLLM's. After a known set of
requests (a batch, a request with n samples, a stream) every counter equals what the same
generate calls report in their statistics, counted once per generation, not once per request."""
import pytest
from prometheus_client.parser import text_string_to_metric_families

import draftsman

from serving import NEW, call, events, queue_while_busy, running, scrape


@pytest.fixture()
def fresh_server(chat_target):
    folder, _ = chat_target
    # The target drafting for itself: drafts are accepted (a random target's n-grams seldom are),
    # and greedy rounds draft a tree of 6 nodes and depth 3.
    decoder = draftsman.load({"target": {"path": str(folder)},
                              "drafter": {"name": "draft_model", "path": str(folder), "k": 3, "top_k": 2,
                                          "total_tokens": 6}})
    with running(decoder) as (server, base):
        yield server, decoder, base


def test_counters_equal_the_generations_statistics(fresh_server):
    server, decoder, base = fresh_server
    before = scrape(base)
    assert before[("draftsman:served_info", (("drafter", "draft_model"), ("model_name", "tiny")))] == 1
    assert before[("draftsman:generation_tokens_total", ())] == 0
    prompts = ["def parse(text):\n", "x = [", "import os\nimport"]
    # Two greedy requests queued while busy run as one batch of 2 rows; then one request with n=2
    # samples (seeded: alone); then a stream.
    queue_while_busy(server, base, [{"prompt": p, "max_tokens": NEW} for p in prompts[:2]])
    status, _ = call(base, "/v1/completions", {"prompt": prompts[2], "max_tokens": NEW, "n": 2, "temperature": 1.0,
                                               "seed": 5})
    assert status == 200
    events(base, "/v1/completions", {"prompt": prompts[0], "max_tokens": NEW - 4, "stream": True})

    runs = [(decoder.encode(prompts[:2]), decoder.generate(prompts[:2], max_new_tokens=NEW).stats),
            (decoder.encode(prompts[2:]), decoder.generate(prompts[2:], max_new_tokens=NEW, num_return_sequences=2,
                                                           temperature=1.0, seed=5).stats),
            (decoder.encode(prompts[:1]), decoder.generate(prompts[:1], max_new_tokens=NEW - 4).stats)]
    got = scrape(base)
    value = lambda name, **labels: got.get((f"draftsman:{name}", tuple(sorted(labels.items()))), 0)  # noqa: E731
    assert value("batches_total") == 3 and value("batch_rows_total") == 2 + 2 + 1
    assert value("target_passes_total") == sum(s.rounds for _, s in runs)
    assert value("target_pass_rows_total") == sum(s.row_rounds for _, s in runs) > value("target_passes_total")
    assert value("prompt_tokens_total") == sum(len(row) for ids, _ in runs for row in ids)
    assert value("generation_tokens_total") == sum(s.new_tokens for _, s in runs)
    reasons = [r for _, s in runs for r in s.finish_reasons]
    for reason in set(reasons):
        assert value("request_success_total", finished_reason=reason) == reasons.count(reason)
    assert value("spec_decode_num_drafts_total") == sum(s.proposed_at_depth[0] for _, s in runs if s.proposed_at_depth)
    assert value("spec_decode_num_draft_tokens_total") == sum(s.proposed_tokens for _, s in runs) > 0
    assert value("spec_decode_num_accepted_tokens_total") == sum(sum(map(sum, s.accepted_per_round)) for _, s in runs)
    assert value("spec_decode_num_accepted_tokens_total") > 0
    depth = max(len(s.proposed_at_depth) for _, s in runs)
    assert depth == 3
    # a tree has more nodes than levels: draft tokens count nodes
    assert value("spec_decode_num_draft_tokens_total") > sum(
        value("spec_decode_num_drafts_per_pos_total", position=str(d)) for d in range(depth))
    for d in range(depth):
        assert value("spec_decode_num_drafts_per_pos_total", position=str(d)) == sum(
            s.proposed_at_depth[d] for _, s in runs if d < len(s.proposed_at_depth))
        assert value("spec_decode_num_accepted_tokens_per_pos_total", position=str(d)) == sum(
            s.accepted_at_depth[d] for _, s in runs if d < len(s.accepted_at_depth))
    assert value("generation_seconds_total", phase="total") > value("generation_seconds_total", phase="verify") > 0
    # Per request (4 answered): latency and size histograms, vLLM's names.
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert value(f"{name}_count") == 4, name
    assert value("request_generation_tokens_sum") == value("generation_tokens_total")
    assert value("request_prompt_tokens_sum") == value("prompt_tokens_total")
    assert value("e2e_request_latency_seconds_sum") == pytest.approx(
        value("request_queue_time_seconds_sum") + value("request_inference_time_seconds_sum"))
    assert 0 < value("time_to_first_token_seconds_sum") < value("e2e_request_latency_seconds_sum")
    assert value("request_queue_time_seconds_sum") > 0  # two of them waited while the test held the server


def test_a_requests_timeline_lands_in_its_buckets():
    from draftsman.serve_batch import RequestTimes
    from draftsman.serve_metrics import ServeMetrics

    metrics = ServeMetrics("tiny", "ngram")
    metrics.record_request(RequestTimes(arrived=10.0, started=10.5, first_token=11.0, last_token=12.0, finished=12.2,
                                        prompt_tokens=7, generation_tokens=5))
    got = {(s.name, tuple(s.labels.items())): s.value
           for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}

    def sums(name):
        return got[(f"draftsman:{name}_sum", ())]

    assert sums("e2e_request_latency_seconds") == pytest.approx(2.2)
    assert sums("request_queue_time_seconds") == pytest.approx(0.5)
    assert sums("request_inference_time_seconds") == pytest.approx(1.7)
    assert sums("time_to_first_token_seconds") == pytest.approx(1.0)
    assert sums("time_per_output_token_seconds") == pytest.approx(0.25)  # 1 s over the 4 gaps after the first
    assert (sums("request_prompt_tokens"), sums("request_generation_tokens")) == (7, 5)
    bucket = lambda name, le: got[(f"draftsman:{name}_bucket", (("le", le),))]  # noqa: E731
    assert (bucket("e2e_request_latency_seconds", "2.0"), bucket("e2e_request_latency_seconds", "3.0")) == (0, 1)


def test_record_counts_rounds_with_a_draft_not_every_round():
    from draftsman.api import GenerationStats
    from draftsman.serve_metrics import ServeMetrics

    # Two rows, 5 row-rounds; only 2 of them had a draft (an n-gram drafter finds none in the others).
    stats = GenerationStats(rounds=3, row_rounds=5, new_tokens=8, accepted_per_round=[[2, 0, 0], [1, 0]],
                            proposed_at_depth=[2, 2, 1], accepted_at_depth=[2, 1, 0], proposed_tokens=7,
                            finish_reasons=["eos", "length"])
    metrics = ServeMetrics("m", "ngram")
    metrics.record([[1, 2, 3], [4]], stats)
    got = {(s.name, tuple(s.labels.values())): s.value
           for family in text_string_to_metric_families(metrics.exposition().decode()) for s in family.samples}
    assert got[("draftsman:spec_decode_num_drafts_total", ())] == 2
    assert got[("draftsman:spec_decode_num_draft_tokens_total", ())] == 7
    assert got[("draftsman:spec_decode_num_accepted_tokens_total", ())] == 3
    assert [got[("draftsman:spec_decode_num_accepted_tokens_per_pos_total", (str(d),))] for d in range(3)] == [2, 1, 0]
    assert [got[("draftsman:spec_decode_num_drafts_per_pos_total", (str(d),))] for d in range(3)] == [2, 2, 1]
    assert got[("draftsman:prompt_tokens_total", ())] == 4 and got[("draftsman:generation_tokens_total", ())] == 8
    assert got[("draftsman:request_success_total", ("eos",))] == 1
    assert got[("draftsman:request_success_total", ("length",))] == 1
    assert got[("draftsman:batch_rows_total", ())] == 2 and got[("draftsman:batches_total", ())] == 1


def test_a_scrape_sees_a_record_whole_or_not_at_all():
    """A scrape while a generation is being recorded waits for the record to end: the counters it
    reads agree (here the record pauses after counting the batch, before its target passes)."""
    import threading

    from draftsman.api import GenerationStats
    from draftsman.serve_metrics import ServeMetrics

    metrics = ServeMetrics("m", "ngram")
    paused, resume = threading.Event(), threading.Event()
    count_passes = metrics.target_passes.inc

    def slow_inc(amount=1):
        paused.set()
        resume.wait(10)
        count_passes(amount)
    metrics.target_passes.inc = slow_inc
    stats = GenerationStats(rounds=3, row_rounds=3, new_tokens=5, accepted_per_round=[[1, 1, 0]],
                            finish_reasons=["length"])
    recording = threading.Thread(target=metrics.record, args=([[1, 2]], stats))
    recording.start()
    assert paused.wait(10)
    scraped = []
    scraping = threading.Thread(target=lambda: scraped.append(metrics.exposition().decode()))
    scraping.start()
    scraping.join(0.3)
    resume.set()  # (a scrape that did not wait has its text already)
    recording.join(10)
    scraping.join(10)
    got = {s.name: s.value for family in text_string_to_metric_families(scraped[0]) for s in family.samples}
    assert got["draftsman:batches_total"] == 1
    assert got["draftsman:target_passes_total"] == 3 and got["draftsman:generation_tokens_total"] == 5


def test_waiting_and_running_gauges(fresh_server, monkeypatch):
    import threading
    import time

    server, decoder, base = fresh_server
    gauge = lambda name: scrape(base)[(f"draftsman:num_requests_{name}", ())]  # noqa: E731
    running_seen = []
    stream_batch = decoder.stream_batch

    def spying_stream_batch(*args, **kwargs):  # the gauges as a scrape sees them mid-generation
        running_seen.append((gauge("running"), gauge("waiting")))
        return stream_batch(*args, **kwargs)

    monkeypatch.setattr(decoder, "stream_batch", spying_stream_batch)
    threads = [threading.Thread(target=call, args=(base, "/v1/completions", {"prompt": p, "max_tokens": NEW}))
               for p in ("x = [", "if x:\n")]
    with server.generating:
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while len(server.batcher.waiting) < 2:
            assert time.time() < deadline
            time.sleep(0.01)
        assert (gauge("waiting"), gauge("running")) == (2, 0)
    for t in threads:
        t.join(60)
    assert running_seen == [(2, 0)]  # one batch of both requests, none left waiting
    assert (gauge("waiting"), gauge("running")) == (0, 0)
    events(base, "/v1/completions", {"prompt": "x = [", "max_tokens": NEW, "stream": True})
    assert running_seen[-1] == (1, 0) and gauge("running") == 0  # a stream alone is a batch of one, and counts
