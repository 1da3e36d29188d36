"""Requests that arrive while the server is generating wait, and then run together as one batch.
With a drafter that can add rows (every built-in one), a waiting request also joins the batch
that is running, between two rounds, as vLLM's scheduler adds requests at every step
(continuous batching): it need not wait for the batch's longest row. On this project's 2-core
CPU plain decoding makes 2.2x more tokens per second at batch 4 than at batch 1, so clients that
come at once are served sooner.

Requests share a batch only when every setting but max_tokens, min_tokens, stop, stop_token_ids,
ignore_eos, the warpers (temperature, top_p, top_k, min_p, typical_p, ...), the penalties
(repetition, presence, frequency), logit_bias and the bans (no_repeat_ngram_size, bad_words_ids)
is the same (those are per row: PER_ROW_SETTINGS; a setting sent with the config's value, or a NEUTRAL one, is
the same as one left out; logprobs, top_logprobs and n differ freely: the batch scores every row
and each request gets the scores it asked for, and the batch holds each prompt n times, its
request's n),
up to `max_rows` rows running at once;
the first waiting request always runs, whatever its size. Requests join a running batch in
the order they came: one with other settings, or too many rows, at the head of the queue stops
the joining until the batch ends (nothing waits for ever behind later arrivals). A request with
a `seed` runs alone: its output is then what the same request gives on its own. Under (lossy)
typical acceptance the per-row sampling settings keep requests apart too: it takes one setting
for the whole batch.
Every batch runs through Decoder.stream_batch, streamed requests and the others alike: each
request reads its own rows as rounds commit them, and is answered as soon as its rows have
ended, not when the batch's longest row does.
Every row stays exact: a batch's rows are verified row by row (greedy equality at batch 4 in
tests/test_greedy_equality.py, the chi-square suites at batch > 1), and a row that joined
generates what it generates alone (tests/test_continuous_batching.py).

One runner thread at a time: the first request that finds none waiting starts it; it runs
batches, each under the generation lock, while requests wait, and ends when none do.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
import time

from .api import Decoder, GenerationOutput, GenerationStats, JoiningPrompt, StreamChunk
from .verifier.sampling import ROW_FIELDS


@dataclasses.dataclass
class RequestTimes:
    """One answered request's timeline (time.perf_counter seconds) and sizes, for the metrics."""
    arrived: float  # it began to wait
    started: float  # its batch began
    first_token: float | None  # its first token came (None: it generated none)
    last_token: float | None  # its last token came
    finished: float  # its last row ended
    prompt_tokens: int  # over its prompts, each once whatever its n
    generation_tokens: int  # over its rows


# Requests that differ only in these share a batch: the engine takes them per row (the warpers:
# temperature, top_p, top_k, min_p, ..., the penalties, logit_bias and the bans: verifier/sampling.py's
# ROW_FIELDS), and the decoder decodes each row's text keeping its own special tokens (keep_in_text:
# a chat reply under a parser keeps its markers, a completion beside it none) and, or not, the stop
# string that ended it (include_stop_str_in_output).
PER_ROW_SETTINGS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "keep_in_text",
                    "include_stop_str_in_output", *ROW_FIELDS)
# Requests that differ in these share a batch too: the batch records the scores of every row, as
# many top tokens as its requests ask at most, and each request gets what it asked for. A request
# that asks for more than a running batch records waits for the next one.
SCORE_SETTINGS = ("logprobs", "top_logprobs")
# And n: the batcher gives the engine each prompt of a request n times (prefilled once), so
# requests with other n share a batch as well.
SAMPLES = "num_return_sequences"
# Values that change nothing (clients send "lossy_typical_acceptance": false with every request):
# where the config has no such setting either, a request that sends one is the same as one that
# leaves it out, and the two share a batch (which runs with either value: they act alike). The
# per-row settings (penalties, logit_bias, bans, ...) need no entry.
NEUTRAL = {"lossy_typical_acceptance": False}


def _as_default(key: str, value, defaults: dict) -> bool:
    """Whether a request's value of a setting acts as the config's: it is the config's, or it
    changes nothing where the config's changes nothing either."""
    if key not in defaults:
        return False
    default = defaults[key]
    if value == default:
        return True
    return key in NEUTRAL and value == NEUTRAL[key] and (default is None or default == NEUTRAL[key])


class _Job:
    """One request: its prompts and settings, and the queue its answer comes through: ("chunk",
    (row, StreamChunk)) then ("end", stats) for a stream; ("done", GenerationOutput) for the
    others; or ("error", exception)."""

    def __init__(self, ids: list[list[int]], args: dict, stream: bool = False, defaults: dict | None = None):
        self.ids, self.args, self.stream = ids, args, stream
        self.n = args.get(SAMPLES, 1)
        self.rows = len(ids) * self.n
        # Settings as a comparable string (not PER_ROW_SETTINGS, SCORE_SETTINGS nor n: a batch
        # takes them per row); None: this job runs alone. A setting sent with its
        # default value (the config's), or a NEUTRAL one, is the same as one left out, as
        # benchmark clients send them: such a request keeps no other apart.
        defaults = defaults or {}
        # Typical acceptance takes one sampling setting for the whole batch (LOSSY; verifier/
        # typical.py): under it the sampling settings keep requests apart too.
        typical = args.get("lossy_typical_acceptance", defaults.get("lossy_typical_acceptance"))
        per_row = [k for k in PER_ROW_SETTINGS if not (typical and k in ROW_FIELDS)]
        settings = {k: v for k, v in args.items() if k not in per_row and k not in SCORE_SETTINGS
                    and k != SAMPLES and not _as_default(k, v, defaults)}
        self.key = None if "seed" in args else json.dumps(settings, sort_keys=True, default=str)
        # The top tokens asked per scored token (0: the token's own score only); None: no scores.
        self.top: int | None = (args.get("top_logprobs") or 0) if args.get("logprobs") else None
        self.batch_rows = 0  # rows running in its batch when it started, its own included
        self.queue: queue.Queue = queue.Queue()
        self.sent = False  # a chunk reached it: the batch can no longer be rerun request by request
        self.stats: GenerationStats | None = None  # a stream's, once it has ended
        self.cancelled = False
        self._abort: tuple[set, int] | None = None  # (its batch's aborted rows, its first row), once running
        self._chunks: list[list[StreamChunk]] = [[] for _ in range(self.rows)]
        self._reasons: list[str | None] = [None] * self.rows
        self._answered = False
        self.arrived = time.perf_counter()
        self.started: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0
        self.on_answer = None  # called with its RequestTimes when it is answered

    def cancel(self) -> None:
        """Its client went away: its rows end after the round they are in, so they stop costing
        the batch target passes."""
        self.cancelled = True
        if self._abort is not None:
            rows, first = self._abort
            rows.update(range(first, first + self.rows))

    def deliver(self, row: int, chunk: StreamChunk, stats: GenerationStats, before_answer=None) -> None:
        """Chunk of its row `row` (counted within this job); answers once its last row has ended,
        after calling before_answer() (the metrics: a client that reads them on its answer sees
        its own request counted)."""
        chunk = self._own_scores(chunk)
        self.sent = True
        if chunk.token_ids:
            self.last_token = time.perf_counter()
            if self.first_token is None:
                self.first_token = self.last_token
        self.tokens += len(chunk.token_ids)
        if self.stream:
            self.queue.put(("chunk", (row, chunk)))
        else:
            self._chunks[row].append(chunk)
        if chunk.finish_reason is None:
            return
        self._reasons[row] = chunk.finish_reason
        if all(reason is not None for reason in self._reasons):  # ended: it need not wait for the batch
            if before_answer is not None:
                before_answer()
            stats = _snapshot(stats, self._reasons)
            self._answered = True
            if self.on_answer is not None:
                self.on_answer(RequestTimes(self.arrived, self.started, self.first_token, self.last_token,
                                            time.perf_counter(), sum(map(len, self.ids)), self.tokens))
            if self.stream:
                self.stats = stats
                self.queue.put(("end", stats))
            else:
                self.queue.put(("done", _output(self._chunks, stats)))

    def _own_scores(self, chunk: StreamChunk) -> StreamChunk:
        """The chunk with the scores this request asked for: none, or its number of top tokens
        (the batch's are the most likely first, as many as its requests ask at most)."""
        if chunk.logprobs is None or (self.top is not None and chunk.top_logprobs is None):
            return chunk
        if self.top is None:
            return dataclasses.replace(chunk, logprobs=None, top_logprobs=None)
        return dataclasses.replace(chunk, top_logprobs=[top[: self.top] for top in chunk.top_logprobs]
                                   if self.top else None)

    def fail(self, error: BaseException) -> None:
        if not self._answered:
            self._answered = True
            self.queue.put(("error", error))


def _snapshot(stats: GenerationStats, reasons: list[str]) -> GenerationStats:
    """The batch's statistics so far, with this request's rows' finish reasons; its lists copied,
    as the batch goes on filling its own (60x faster than deepcopy: 16 requests of 16 rows x 200
    rounds took 10 ms)."""
    return dataclasses.replace(stats, accepted_per_round=[list(row) for row in stats.accepted_per_round],
                               proposed_at_depth=list(stats.proposed_at_depth),
                               accepted_at_depth=list(stats.accepted_at_depth),
                               drafter_report=dict(stats.drafter_report), finish_reasons=list(reasons))


def _output(chunks: list[list[StreamChunk]], stats: GenerationStats) -> GenerationOutput:
    """A request's rows' chunks joined into what generate returns for it."""
    texts = ["".join(c.text for c in row) for row in chunks]
    tokens = [[t for c in row for t in c.token_ids] for row in chunks]
    scored = chunks[0] and chunks[0][0].logprobs is not None
    logprobs = [[v for c in row for v in c.logprobs] for row in chunks] if scored else None
    ranked = scored and chunks[0][0].top_logprobs is not None
    tops = [[t for c in row for t in c.top_logprobs] for row in chunks] if ranked else None
    return GenerationOutput(texts, tokens, stats, logprobs, tops)


class _Progress:
    """What one generation has handed to the metrics so far. Requests keep joining a generation
    under a steady load, so it may run for hours: it is recorded as its requests end, each time
    what it has done since, not only once at its end."""

    def __init__(self, record):
        self._record = record
        self.prompts = 0  # prompts recorded
        self.ended: set[int] = set()  # rows whose finish reason was recorded
        self.accepted = 0  # draft tokens accepted, recorded
        self.done = GenerationStats()  # the other counts recorded

    def record(self, prompts: list[list[int]], stats: GenerationStats) -> None:
        ended = [r for r, reason in enumerate(stats.finish_reasons) if reason and r not in self.ended]
        accepted = sum(map(sum, stats.accepted_per_round))
        done = self.done
        depth = len(stats.proposed_at_depth)
        before = lambda counts: counts + [0] * (depth - len(counts))  # noqa: E731
        since = GenerationStats(
            rounds=stats.rounds - done.rounds, row_rounds=stats.row_rounds - done.row_rounds,
            new_tokens=stats.new_tokens - done.new_tokens, proposed_tokens=stats.proposed_tokens - done.proposed_tokens,
            accepted_per_round=[[accepted - self.accepted]],
            proposed_at_depth=[a - b for a, b in zip(stats.proposed_at_depth, before(done.proposed_at_depth))],
            accepted_at_depth=[a - b for a, b in zip(stats.accepted_at_depth, before(done.accepted_at_depth))],
            draft_seconds=stats.draft_seconds - done.draft_seconds,
            verify_seconds=stats.verify_seconds - done.verify_seconds,
            total_seconds=stats.total_seconds - done.total_seconds,
            finish_reasons=[stats.finish_reasons[r] for r in ended])
        self._record(prompts[self.prompts:], since, new_generation=self.prompts == 0)
        self.prompts = len(prompts)
        self.ended.update(ended)
        self.accepted = accepted
        self.done = dataclasses.replace(stats, accepted_per_round=[],
                                        proposed_at_depth=list(stats.proposed_at_depth),
                                        accepted_at_depth=list(stats.accepted_at_depth), finish_reasons=[])


POLL_SECONDS = 0.1  # how often a waiting request asks whether its client is still there


class ServerStopping(RuntimeError):
    """The server stopped before the request ran (answered with 503)."""

    def __init__(self):
        super().__init__("the server is stopping: send the request again once it is back")


class ClientGone(ConnectionError):
    """The request's client disconnected before its answer: nobody to answer."""


class _ModelTask:
    """Work on the models outside a generation (an echo's prompt scoring), run once under the lock."""

    def __init__(self, work):
        self.work, self.done, self.result, self.error = work, threading.Event(), None, None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as e:  # noqa: BLE001  raised again in the request's own thread
            self.error = e
        finally:
            self.done.set()


def check_max_rows(max_rows: int) -> None:
    if max_rows < 1:
        raise ValueError(f"--max-batch-rows must be >= 1 (1 serves one request at a time), got {max_rows}")


class Batcher:
    # Rows one generation takes in all before it stops taking more (it ends when its rows do, and
    # the next begins): its per-row tables (statistics, contexts) would grow for as long as
    # requests kept joining it, and each answered request copies the statistics.
    max_generation_rows = 1024

    def __init__(self, decoder: Decoder, lock: threading.Lock, max_rows: int = 16, record=None,
                 record_request=None):
        """lock: held while a batch generates (the server scores prompts under it too, and tests
        hold it to keep requests waiting). record(ids, stats): called once per generation with its
        prompts and statistics; record_request(RequestTimes): once per request answered (the
        server's metrics)."""
        check_max_rows(max_rows)
        self.decoder, self.lock, self.max_rows, self.record = decoder, lock, max_rows, record
        # generate's arguments as the config sets them, when a request leaves them out
        self.defaults = {**decoder.config["sampling"], **decoder.config["generation"], "num_return_sequences": 1,
                         "keep_in_text": None, "include_stop_str_in_output": False}
        self.record_request = record_request
        self.waiting: list[_Job] = []
        self.running = 0  # requests in the generation now running
        self._waiting_lock = threading.Lock()
        self._runner = False  # a runner thread is serving the waiting requests
        # A drafter's memory_file is written between rounds at most this often (seconds; None:
        # only at exit; 0: after every round): a server killed outright loses at most this much
        # of what it learnt.
        self.save_memory_every: float | None = None
        self._memory_saved_at = time.monotonic()
        self._owner: list = []  # the running generation's (job, row) pairs, joined rows included
        self.stopping = False
        self._model_tasks: list[_ModelTask] = []  # with_models' work not yet run (under _waiting_lock)

    def generate(self, ids: list[list[int]], args: dict, gone=None) -> tuple[GenerationOutput, int]:
        """Decoder.generate(input_ids=ids, **args), maybe in a batch with other waiting requests:
        this request's output, and how many rows the batch it ran in had. gone() -> True once its
        client has left: it is then dropped from the queue, or its rows end (finish reason
        "abort"), and ClientGone is raised."""
        job = self._submit(_Job(ids, args, defaults=self.defaults))
        kind, item = self._next(job, gone)
        if kind == "error":
            raise item
        return item, job.batch_rows

    def stream(self, ids: list[list[int]], args: dict, gone=None):
        """Decoder.stream_batch(ids, **args), maybe in a batch with other waiting requests: yields
        this request's (row, StreamChunk) as rounds commit them, rows counted within the request
        (prompt by prompt, n samples each); afterwards `job.stats` (the batch's, with these rows'
        finish reasons) and `job.batch_rows`. Returns (job, chunks). gone: as generate's, watched
        while no chunk comes."""
        job = self._submit(_Job(ids, args, stream=True, defaults=self.defaults))
        return job, self._chunks(job, gone)

    def _next(self, job: _Job, gone) -> tuple[str, object]:
        """The job's next item; while none comes, ask gone() every POLL_SECONDS."""
        while True:
            try:
                return job.queue.get(timeout=POLL_SECONDS if gone is not None else None)
            except queue.Empty:
                if gone():
                    self.drop(job)
                    raise ClientGone()

    def drop(self, job: _Job) -> None:
        """Its client left: out of the queue if it still waits, else its rows end after this round."""
        with self._waiting_lock:
            if job in self.waiting:
                self.waiting.remove(job)
                return
        job.cancel()

    def _chunks(self, job: _Job, gone=None):
        while True:
            kind, item = self._next(job, gone)
            if kind == "chunk":
                yield item
            elif kind == "end":
                return
            else:
                raise item

    def _submit(self, job: _Job) -> _Job:
        job.on_answer = self.record_request
        if self.stopping:
            job.fail(ServerStopping())
            return job
        with self._waiting_lock:
            self.waiting.append(job)
            if not self._runner:
                self._runner = True
                threading.Thread(target=self._serve_waiting, daemon=True).start()
        return job

    def _serve_waiting(self) -> None:
        """Batches while requests wait; each taken once the lock is free, so the requests that came
        meanwhile join it."""
        while True:
            with self.lock:
                with self._waiting_lock:  # checked and taken at once: a client that leaves may drop()
                    batch = self._take()  # the only waiting job between a check and a take
                    if not batch:
                        self._runner = False
                        return
                self._run(batch)  # (which saves the drafter's memory when due)

    def with_models(self, work):
        """work() under the models' lock, without waiting for the running generation to end: under
        a steady load requests keep joining it, so it may run for hours (an echo's scoring waited
        18 s behind three looping clients). The runner calls it between two rounds; with no
        generation running it runs here."""
        task = _ModelTask(work)
        with self._waiting_lock:
            self._model_tasks.append(task)
        while not task.done.is_set():
            if self.lock.acquire(timeout=POLL_SECONDS):
                try:
                    self._run_model_tasks()
                finally:
                    self.lock.release()
        if task.error is not None:
            raise task.error
        return task.result

    def _run_model_tasks(self) -> None:
        """Under the lock: the with_models work waiting, each taken once."""
        if not self._model_tasks:  # (read without the lock: one round's delay at most)
            return
        with self._waiting_lock:
            tasks, self._model_tasks = self._model_tasks, []
        for task in tasks:
            task.run()

    def stop(self) -> None:
        """The server is stopping: requests still waiting are answered with an error, and the rows
        running end after the round they are in (finish reason "abort"), so the batch lets go of
        the drafter within a round."""
        self.stopping = True
        with self._waiting_lock:
            waiting, self.waiting = self.waiting, []
        for job in waiting:
            job.fail(ServerStopping())
        for job in {job for job, _ in list(self._owner)}:
            job.cancel()

    def finish_at_exit(self, wait: float = 10.0) -> None:
        """After stop(): waits for the running batch to let go of the models (within a round), then
        saves the drafter's memory if it keeps one (it is not read while it changes). The wait
        matters without memory too: a process that exits while the runner thread is inside a torch
        call dies of SIGABRT, and its clients get no answer. After `wait` seconds it gives up (the
        last save stands)."""
        if not self.lock.acquire(timeout=wait):
            unsaved = "; drafter memory not saved, the last save stands" if self.decoder.drafter.memory_files() else ""
            print(f"a batch still ran after {wait:.0f} s{unsaved}", file=sys.stderr)
            return
        try:
            if self.decoder.drafter.memory_files():
                self._save_memory()
        finally:
            self.lock.release()

    def _save_memory_if_due(self) -> None:
        """Under the lock, between a generation's rounds (its last included): under steady load
        one generation may run for hours (requests join it as others end), and a save only
        between generations would wait for it."""
        every = self.save_memory_every
        if every is not None and time.monotonic() - self._memory_saved_at >= every:
            self._save_memory()

    def _save_memory(self) -> None:
        """Under the lock. A failed write (disk full) is reported, and serving goes on: the runner
        thread must not die of it, or no request would be served again."""
        self._memory_saved_at = time.monotonic()
        try:
            for path in self.decoder.save_drafter_memory():
                print(f"drafter memory saved to {path}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001
            print(f"drafter memory not saved: {e}", file=sys.stderr)

    @staticmethod
    def _enter(job: _Job, owner: list, prompts: list, aborted: set, started: float) -> None:
        """The job's rows become the batch's next ones."""
        job.started = started
        job._abort = (aborted, len(owner))
        owner += [(job, row) for row in range(job.rows)]
        prompts += job.ids
        if job.cancelled:  # cancelled before its _abort was set
            job.cancel()

    def _joining(self, first: _Job, owner: list, prompts: list, aborted: set, stats: GenerationStats,
                 joined_jobs: list, batch_top: int | None):
        """stream_batch's joining for a running batch: the waiting jobs at the head of the queue
        with its settings, while their rows fit beside the rows still running. The queue keeps
        its order: a job with other settings at its head stops joining until this batch ends, so
        nothing waits behind later arrivals for ever."""
        def joining():
            with self._waiting_lock:
                if not self.waiting or len(owner) >= self.max_generation_rows:
                    return []
                running = sum(1 for reason in stats.finish_reasons if not reason)
                taken = []
                for job in self.waiting:
                    if job.key != first.key or running + job.rows > self.max_rows or \
                            (job.top is not None and (batch_top is None or job.top > batch_top)):
                        break
                    taken.append(job)
                    running += job.rows
                self.waiting = self.waiting[len(taken):]
            entered, now = [], time.perf_counter()
            for job in taken:
                own = {key: self.defaults[key] if job.args.get(key) is None else job.args[key]
                       for key in PER_ROW_SETTINGS}
                try:
                    self.decoder.check_join(job.ids, num_return_sequences=job.n, **own)
                except ValueError as e:  # this request's own problem (e.g. a prompt too long): it alone fails
                    job.fail(e)
                    running -= job.rows
                    continue
                self._enter(job, owner, prompts, aborted, now)
                entered.append((job, own))
            for job, _ in entered:
                job.batch_rows = running  # the rows it runs beside, its own included
            joined_jobs.extend(job for job, _ in entered)
            self.running += len(entered)
            # Its own stops as [] when it has none, its kept tokens the decoder's: None would take the batch's.
            return [JoiningPrompt(ids, own["max_new_tokens"], own["min_new_tokens"], own["stop"] or [],
                                  own["stop_token_ids"] or [], {key: own[key] for key in ROW_FIELDS},
                                  own["ignore_eos"], self._kept(own["keep_in_text"]), own["include_stop_str_in_output"])
                    for job, own in entered for ids in job.ids for _ in range(job.n)]
        return joining

    def _kept(self, keep_in_text: list[str] | None) -> list[str]:
        """A row's special tokens kept in its text; None: the decoder's own."""
        return list(self.decoder.kept_in_text.values()) if keep_in_text is None else keep_in_text

    def _take(self) -> list[_Job]:
        """The first waiting job, and the later ones with its settings, while the rows fit ([]:
        none waits). The caller holds _waiting_lock."""
        if not self.waiting:
            return []
        first = self.waiting[0]
        batch, rows = [first], first.rows
        if first.key is not None:
            for job in self.waiting[1:]:
                if job.key == first.key and rows + job.rows <= self.max_rows:
                    batch.append(job)
                    rows += job.rows
        self.waiting = [job for job in self.waiting if job not in batch]
        return batch

    def _run(self, batch: list[_Job]) -> None:
        self.running = len(batch)
        try:
            try:
                self._run_rows(batch)
            except ValueError:  # an input check fails before any row (e.g. a prompt too long): each
                if len(batch) == 1 or any(job.sent for job in batch):  # request runs alone, so each
                    raise  # gets its own answer or its own error
                for job in batch:
                    try:
                        self._run_rows([job])
                    except Exception as e:  # noqa: BLE001  (its handler answers with it)
                        job.fail(e)
        except Exception as e:  # noqa: BLE001  the batch failed (e.g. out of memory): all say so
            for job in batch:
                job.fail(e)
        finally:
            self.running = 0
            self._owner = []

    def _run_rows(self, jobs: list[_Job]) -> None:
        """One generation for the jobs' rows, each chunk handed to the job whose row it is; with a
        drafter that can add rows, waiting jobs with the same settings join it between rounds."""
        owner, prompts, aborted = [], [], set()
        self._owner = owner  # what stop() ends
        started = time.perf_counter()
        for job in jobs:
            self._enter(job, owner, prompts, aborted, started)  # (a rerun alone after a bad input starts it again)
        for job in jobs:
            job.batch_rows = len(owner)
        stats = GenerationStats()
        for job in jobs:
            if job.n > 1:  # n samples at temperature 0 would be identical rows: refused alone
                self.decoder.check_join(job.ids, num_return_sequences=job.n,
                                        **{key: job.args.get(key) for key in ROW_FIELDS})
        settings = {k: v for k, v in jobs[0].args.items() if k not in SCORE_SETTINGS and k != SAMPLES}
        asked = [job.top for job in jobs if job.top is not None]
        batch_top = max(asked) if asked else None  # the scores the batch records, for every row
        if batch_top is not None:
            settings.update(logprobs=True, top_logprobs=batch_top)
        joined: list[_Job] = []
        if self.decoder.can_join and jobs[0].key is not None:
            settings["joining"] = self._joining(jobs[0], owner, prompts, aborted, stats, joined, batch_top)
        for key in PER_ROW_SETTINGS:
            values = [job.args.get(key) for job in jobs]
            if any(value != values[0] for value in values):  # one per prompt; a request that gave none takes
                default = self.defaults[key]  # the config's
                settings[key] = [default if value is None else value
                                 for job, value in zip(jobs, values) for _ in range(job.rows)]
        # The engine's rows, job by job as `owner` has them: each prompt n times (its own n), in a row.
        progress = _Progress(self.record) if self.record is not None else None

        def answering() -> None:  # before each request's answer: a client that then reads the metrics
            self.running -= 1  # sees its request counted, and no longer running
            if progress is not None:
                progress.record(prompts, stats)

        try:
            rows = [job.ids[row // job.n] for job, row in owner]
            for row, chunk in self.decoder.stream_batch(rows, stats=stats, aborted=aborted, **settings):
                job, job_row = owner[row]
                job.deliver(job_row, chunk, stats, before_answer=answering)
                # The engine yields after its drafter has seen the round: its memory is whole here
                # (a running row's output so far is saved as a cached one).
                self._save_memory_if_due()
                self._run_model_tasks()
        except Exception as e:  # the jobs that joined are answered here; the batch's own by _run
            for job in joined:
                job.fail(e)
            raise
        if progress is not None:
            progress.record(prompts, stats)
