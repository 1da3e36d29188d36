"""Requests that arrive while the server is generating wait, and then run together as one batch
(batching at generation boundaries, as TGI's router does between its batches; vLLM's scheduler
does it continuously, at every step). On this project's 2-core CPU plain decoding makes 2.2x more
tokens per second at batch 4 than at batch 1, so clients that come at once are served sooner.

Requests join one batch only when every setting is the same (one `generate` call takes one set of
settings), up to `max_rows` rows; the first waiting request always runs, whatever its size. A
request with a `seed` runs alone: its output is then what the same request gives on its own.
Streamed requests batch with streamed ones (Decoder.stream_batch): each reads its own rows'
chunks from a queue as rounds commit them.
Every row stays exact: a batch's rows are verified row by row (greedy equality at batch 4 in
tests/test_greedy_equality.py, the chi-square suites at batch > 1).

No thread of its own: whichever waiting request takes the generation lock first runs the batch
for itself and the others, then each reads its own rows. A streamed request that takes the lock
starts a thread for the batch instead, and reads its chunks from its queue as the others do.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading

from .api import Decoder, GenerationOutput, GenerationStats


class _Job:
    def __init__(self, ids: list[list[int]], args: dict, stream: bool = False):
        self.ids, self.args, self.stream = ids, args, stream
        self.rows = len(ids) * args.get("num_return_sequences", 1)
        # Settings as a comparable string; None: this job runs alone.
        self.key = None if "seed" in args else json.dumps([stream, args], sort_keys=True, default=str)
        self.output: GenerationOutput | None = None
        self.batch_rows = 0
        self.error: BaseException | None = None
        self.done = False
        # Streams: the batch's runner puts ("chunk", StreamChunk), then ("end", stats) or ("error", e).
        self.taken = threading.Event()
        self.queue: queue.Queue = queue.Queue()
        self.sent = False  # a chunk went out: the batch can no longer be rerun request by request
        self.stats: GenerationStats | None = None
        self.cancelled = False
        self._abort: tuple[set, int] | None = None  # (its batch's aborted rows, its row), once running

    def cancel(self) -> None:
        """Its reader went away (a stream whose client disconnected): its row ends after the
        round it is in, so it stops costing the batch target passes."""
        self.cancelled = True
        if self._abort is not None:
            rows, row = self._abort
            rows.add(row)


def check_max_rows(max_rows: int) -> None:
    if max_rows < 1:
        raise ValueError(f"--max-batch-rows must be >= 1 (1 serves one request at a time), got {max_rows}")


class Batcher:
    def __init__(self, decoder: Decoder, lock: threading.Lock, max_rows: int = 16, record=None):
        """record(ids, stats): called once per generate call with its prompts and statistics
        (the server's metrics)."""
        check_max_rows(max_rows)
        self.decoder, self.lock, self.max_rows, self.record = decoder, lock, max_rows, record
        self.waiting: list[_Job] = []
        self.running = 0  # requests in the generation now running (a batch, or one stream)
        self._waiting_lock = threading.Lock()

    def generate(self, ids: list[list[int]], args: dict) -> tuple[GenerationOutput, int]:
        """Decoder.generate(input_ids=ids, **args), maybe in a batch with other waiting requests:
        this request's output, and how many rows the batch it ran in had."""
        job = _Job(ids, args)
        with self._waiting_lock:
            self.waiting.append(job)
        while True:
            with self.lock:
                if not job.done:  # else an earlier holder ran it
                    self._run(self._take())
            if job.done:
                break
        if job.error is not None:
            raise job.error
        return job.output, job.batch_rows

    def _take(self) -> list[_Job]:
        """The first waiting job, and the later ones with its settings, while the rows fit."""
        with self._waiting_lock:
            first = self.waiting[0]
            batch, rows = [first], first.rows
            if first.key is not None:
                for job in self.waiting[1:]:
                    if job.key == first.key and rows + job.rows <= self.max_rows:
                        batch.append(job)
                        rows += job.rows
            self.waiting = [job for job in self.waiting if job not in batch]
        for job in batch:
            job.taken.set()
        return batch

    def stream(self, row: list[int], args: dict):
        """Decoder.stream_chunks(input_ids=row, **args), maybe in a batch with other waiting
        streams: yields this request's StreamChunks as rounds commit them; afterwards `job.stats`
        (the batch's, with this row's finish reason) and `job.batch_rows`. Returns (job, chunks)."""
        job = _Job([row], args, stream=True)
        with self._waiting_lock:
            self.waiting.append(job)
        return job, self._chunks(job)

    def _chunks(self, job: _Job):
        while not job.taken.is_set():
            if not self.lock.acquire(timeout=0.01):  # short: another runner may take this job meanwhile
                continue
            if job.taken.is_set():
                self.lock.release()
                break
            # The batch runs in its own thread, which releases the lock when it ends; this thread
            # reads its chunks as they come, as every other request of the batch does.
            threading.Thread(target=self._run_then_release, args=(self._take(),), daemon=True).start()
        while True:
            kind, item = job.queue.get()
            if kind == "chunk":
                yield item
            elif kind == "end":
                job.stats = item
                return
            else:
                raise item

    def _run_then_release(self, batch: list[_Job]) -> None:
        try:
            self._run(batch)
        finally:
            self.lock.release()

    def _run(self, batch: list[_Job]) -> None:
        if batch[0].stream:
            return self._run_streams(batch)
        self.running = len(batch)
        try:
            if len(batch) > 1:
                try:
                    self._share(self._generate([row for job in batch for row in job.ids], batch[0].args), batch)
                    return
                except ValueError:  # one request's input (e.g. too long for the context): each runs
                    pass  # alone, so each gets its own answer or its own error
            for job in batch:
                try:
                    self._share(self._generate(job.ids, job.args), [job])
                except Exception as e:  # noqa: BLE001  (its handler answers with it)
                    job.error = e
        except Exception as e:  # noqa: BLE001  the batch itself failed (e.g. out of memory): all say so
            for job in batch:
                job.error = e
        finally:
            self.running = 0
            for job in batch:
                job.done = True

    def _run_streams(self, batch: list[_Job]) -> None:
        self.running = len(batch)
        try:
            try:
                self._stream_rows(batch)
            except ValueError:  # an input check fails before any chunk: each request runs alone
                if len(batch) == 1 or any(job.sent for job in batch):
                    raise
                for job in batch:
                    try:
                        self._stream_rows([job])
                    except Exception as e:  # noqa: BLE001  (its handler answers with it)
                        job.queue.put(("error", e))
        except Exception as e:  # noqa: BLE001  the batch failed (e.g. out of memory): all say so
            for job in batch:
                job.queue.put(("error", e))
        finally:
            self.running = 0

    def _stream_rows(self, jobs: list[_Job]) -> None:
        stats, rows = GenerationStats(), [job.ids[0] for job in jobs]
        aborted: set[int] = set()
        for row, job in enumerate(jobs):
            job._abort = (aborted, row)
        aborted.update(row for row, job in enumerate(jobs) if job.cancelled)  # cancelled before the line above
        for row, chunk in self.decoder.stream_batch(rows, stats=stats, aborted=aborted, **jobs[0].args):
            job = jobs[row]
            job.sent = True
            job.queue.put(("chunk", chunk))
            if chunk.finish_reason is not None:  # this request is done: it need not wait for the batch
                job.batch_rows = len(jobs)
                job.queue.put(("end", dataclasses.replace(stats, finish_reasons=[chunk.finish_reason])))
        if self.record is not None:
            self.record(rows, stats)

    def _generate(self, ids: list[list[int]], args: dict) -> GenerationOutput:
        out = self.decoder.generate(input_ids=ids, **args)
        if self.record is not None:
            self.record(ids, out.stats)
        return out

    @staticmethod
    def _share(out: GenerationOutput, batch: list[_Job]) -> None:
        """Each job's rows of a batch's output, with the batch's statistics."""
        total, start = sum(job.rows for job in batch), 0
        for job in batch:
            rows = slice(start, start + job.rows)
            stats = dataclasses.replace(out.stats, finish_reasons=out.stats.finish_reasons[rows])
            job.output = GenerationOutput(out.texts[rows], out.token_ids[rows], stats,
                                          out.logprobs[rows] if out.logprobs is not None else None,
                                          out.top_logprobs[rows] if out.top_logprobs is not None else None)
            job.batch_rows = total
            start += job.rows
