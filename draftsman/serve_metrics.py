"""`GET /metrics` of `draftsman serve`: Prometheus counters of what the server generated and how
its drafts fared, named as vLLM names its own (`draftsman:` for `vllm:`), so a dashboard built
for vLLM's speculative decoding reads them with the prefix changed:

    acceptance rate   = spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens
    mean accepted     = spec_decode_num_accepted_tokens / spec_decode_num_drafts
    acceptance at k   = spec_decode_num_accepted_tokens_per_pos{position=k}
                        / spec_decode_num_drafts_per_pos{position=k}
    mean batch size   = target_pass_rows / target_passes   (rows verified per target pass)
    rows per generation = batch_rows / batches  (requests join a running generation, so a
                        generation's rows are not all there at once)

and the gauges num_requests_waiting and num_requests_running, as vLLM's. Per request answered,
histograms under vLLM's names: time_to_first_token_seconds, e2e_request_latency_seconds,
request_queue_time_seconds (waiting until it starts, in a new batch or joining one),
request_inference_time_seconds (its start until its rows ended), time_per_output_token_seconds
(its mean gap between tokens after the first: a round commits several tokens at once, so single
gaps say little), and request_prompt_tokens / request_generation_tokens.

A draft here is a tree (a chain is one), so draft tokens count its nodes and the positions are
depths. prometheus_client writes the exposition format, as vLLM's server does.
"""
from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from .api import GenerationStats
from .serve_batch import RequestTimes

PREFIX = "draftsman:"
# Seconds from 1 ms to an hour, finer where a CPU server's requests fall (0.1 s to a minute).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                   15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, drafter: str):
        self.registry = r = CollectorRegistry()
        # A scrape sees each record whole: without it, batches could count a generation whose
        # tokens and passes are not yet counted, and the ratios above read wrong for one scrape.
        self._lock = threading.Lock()

        def counter(name: str, doc: str, labels=()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        Info(PREFIX + "served", "The model and drafter this server runs", registry=r).info(
            {"model_name": model_name, "drafter": drafter})
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled, over all rows")
        self.generation_tokens = counter("generation_tokens", "Tokens generated, over all rows")
        self.request_success = counter("request_success", "Rows (choices) finished, by reason",
                                       ["finished_reason"])
        self.batches = counter("batches", "Generations run: one batch of one or more requests, or one stream")
        self.batch_rows = counter("batch_rows", "Rows over all generations, those that joined them included")
        self.target_passes = counter("target_passes", "Target passes after the prefills (one per round)")
        self.target_pass_rows = counter("target_pass_rows", "Rows over all target passes (divided by target "
                                        "passes: mean batch size)")
        self.drafts = counter("spec_decode_num_drafts", "Row-rounds that verified a draft")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.drafts_per_pos = counter("spec_decode_num_drafts_per_pos",
                                      "Row-rounds whose draft reached this depth (0: the first token)", ["position"])
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Row-rounds that accepted the draft token at this depth", ["position"])
        self.seconds = counter("generation_seconds", "Engine time: drafting, target verification, and in all",
                               ["phase"])

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to its first token", LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to its answer", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Waiting until it starts in a batch",
                                    LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Its start in a batch until its rows ended",
                                        LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Per request: mean gap between its tokens after the "
                              "first", TOKEN_GAP_BUCKETS)
        token_buckets = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per request",
                                                   token_buckets)

    def watch(self, batcher) -> None:
        """Gauges read from the batcher at each scrape: requests waiting, and running."""
        Gauge(PREFIX + "num_requests_waiting", "Requests waiting for the model", registry=self.registry
              ).set_function(lambda: len(batcher.waiting))
        Gauge(PREFIX + "num_requests_running", "Requests in the generation now running", registry=self.registry
              ).set_function(lambda: batcher.running)

    def record(self, ids: list[list[int]], stats: GenerationStats, new_generation: bool = True) -> None:
        """A generation's counts: its prompts `ids` (each once, whatever its n: one prefill serves
        all its samples) and its statistics; or, new_generation=False, what a generation that
        requests join has done since it was last recorded (serve_batch records such a
        generation as its requests end, so the counters move while it runs)."""
        with self._lock:
            if new_generation:
                self.batches.inc()
            self.batch_rows.inc(len(stats.finish_reasons))
            self.target_passes.inc(stats.rounds)
            self.target_pass_rows.inc(stats.row_rounds)
            self.prompt_tokens.inc(sum(map(len, ids)))
            self.generation_tokens.inc(stats.new_tokens)
            for reason in stats.finish_reasons:
                self.request_success.labels(finished_reason=reason).inc()
            self.drafts.inc(stats.proposed_at_depth[0] if stats.proposed_at_depth else 0)
            self.draft_tokens.inc(stats.proposed_tokens)
            self.accepted.inc(sum(map(sum, stats.accepted_per_round)))
            for depth, (proposed, accepted) in enumerate(zip(stats.proposed_at_depth, stats.accepted_at_depth)):
                self.drafts_per_pos.labels(position=str(depth)).inc(proposed)
                self.accepted_per_pos.labels(position=str(depth)).inc(accepted)
            for phase, seconds in (("draft", stats.draft_seconds), ("verify", stats.verify_seconds),
                                   ("total", stats.total_seconds)):
                self.seconds.labels(phase=phase).inc(seconds)

    def record_request(self, times: RequestTimes) -> None:
        """One answered request's latencies and sizes."""
        with self._lock:
            self.e2e.observe(times.finished - times.arrived)
            self.queue_time.observe(times.started - times.arrived)
            self.inference_time.observe(times.finished - times.started)
            if times.first_token is not None:
                self.ttft.observe(times.first_token - times.arrived)
                if times.generation_tokens > 1:
                    self.tpot.observe((times.last_token - times.first_token) / (times.generation_tokens - 1))
            self.request_prompt_tokens.observe(times.prompt_tokens)
            self.request_generation_tokens.observe(times.generation_tokens)

    def exposition(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
