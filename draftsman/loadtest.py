"""`draftsman loadtest --url http://HOST:PORT/v1`: clients at once against an OpenAI-compatible
server (`draftsman serve`, or vLLM's, SGLang's...), as vLLM's benchmark_serving measures one:
requests per second, output tokens per second, and each request's latency; with `--stream`, the
time to the first token (TTFT) and per output token after it (TPOT) too. Run it against two
servers on one machine to compare them on the same prompts.

`draftsman serve` batches the requests that wait while it generates, streamed or not
(draftsman/serve_batch.py); `--max-batch-rows 1` there serves one at a time.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

# An HTTP client: nothing here imports torch, so it starts at once on any machine.
from .atomic_files import replaced_whole
from .bench.prompts_set import BUNDLED_PROMPTS, by_category, read_prompts


@dataclass
class Result:
    prompt_id: str
    ok: bool
    error: str = ""
    seconds: float = 0.0  # sent to last byte
    first_token_seconds: float | None = None  # --stream: sent to the first text
    # --stream: the waits between a stream's pieces of text (vLLM's inter-token latency, ITL; a
    # piece holds the tokens of one round): a running stream's stall while another prompt prefills
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    tau: float | None = None  # draftsman serve's tokens per target pass, when the server reports it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, action="append",
                   help="the server's base URL, e.g. http://127.0.0.1:8000/v1; give it again for another server: "
                        "the same load then runs against each in turn, and a side-by-side table follows")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per server, the servers' order flipped every run (medians are compared)")
    p.add_argument("--model", help="the model name to send (default: each server's first of GET /models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--prompts", default=str(BUNDLED_PROMPTS),
                   help='JSONL of {"text"} / {"messages"} / {"input_ids"} / Spec-Bench rows (first turns) '
                        "(default: the bundled held-out prompts)")
    p.add_argument("--categories", help="comma-separated categories of the prompt file to use (default: all)")
    p.add_argument("--requests", type=int, default=32, help="requests to send in all (prompts are reused in turn)")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending at once (with --request-rate: "
                                                              "requests in flight at most)")
    p.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="start requests at random (Poisson) times, R per second on average, whether or not the "
                        "earlier ones have finished (vLLM's benchmark_serving --request-rate); default: each client "
                        "sends its next request when its last one is answered")
    p.add_argument("--seed", type=int, default=0, help="seeds the --request-rate arrival times")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-tokens-min", type=int, metavar="LO",
                   help="vary the lengths: each request's max_tokens is drawn uniformly from [LO, --max-tokens] "
                        "(seeded by --seed; the same draws for every server and run)")
    # The options that send requests differing in a per-row setting: what they tell apart.
    apart = "draftsman serve batches them anyway, {} per row; a server that splits batches by {} would not"
    p.add_argument("--fixed-length", action="store_true",
                   help="also send min_tokens = max_tokens, so every request makes its max_tokens (with "
                        "--max-tokens-min each request then has its own min_tokens; "
                        + apart.format("a minimum", "min_tokens") + ")")
    p.add_argument("--distinct-stops", action="store_true",
                   help="each request also sends a stop string of its own that no output spells ('<|stop-7|>'), "
                        "as clients with their own stop conventions do: " + apart.format("stops", "stop"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", metavar="T,T,...",
                   help="a mix instead of --temperature: request i sends the (i mod count)-th, e.g. 0,0.7,1 for "
                        "clients that sample differently: " + apart.format("warpers", "temperature"))
    p.add_argument("--presence-penalties", metavar="P,P,...",
                   help="request i also sends the (i mod count)-th presence_penalty, e.g. 0,0.5 (0: none sent), "
                        "for clients that penalise differently: " + apart.format("penalties", "penalty"))
    p.add_argument("--no-repeat-ngram-sizes", metavar="N,N,...",
                   help="request i also sends the (i mod count)-th no_repeat_ngram_size, e.g. 0,3 (0: none sent), "
                        "for clients that ban repeats differently: " + apart.format("bans", "no_repeat_ngram_size"))
    p.add_argument("--distinct-biases", action="store_true",
                   help=f"request i also bans a token of its own (logit_bias {{id: -100}}, id 1 + i mod {BIASED_IDS}), "
                        "as clients that each ban their own tokens do: " + apart.format("biases", "logit_bias"))
    p.add_argument("--stream", action="store_true", help="stream, and measure the time to the first token")
    p.add_argument("--json", dest="json_out",
                   help="also write every request's result and the summary here; with --repeats or several --url, "
                        "every run's are under 'runs' (url, repeat, summary, results), and the top-level "
                        "'summary' and 'results' are the first run's only (the first --url's first repeat)")


BIASED_IDS = 16  # --distinct-biases bans ids 1..16 (0 is EOS in GPT-2-style vocabularies)


def number_mix(text: str, flag: str, example: str) -> list[float]:
    """A flag's mix of numbers >= 0: --temperatures "0,0.7,1" -> [0.0, 0.7, 1.0]."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(t) and t >= 0 for t in values):  # nan passes a `t < 0` check
        raise ValueError(f"{flag} takes numbers >= 0 separated by commas, e.g. {example}; got {text!r}")
    return values


def request_fields(args: argparse.Namespace, lengths: list[int]) -> list[dict]:
    """Each request's fields besides the prompt and the model: its max_tokens (`lengths`), and
    what the mixing options give request i (the (i mod count)-th of a mix; a penalty or a ban of
    0 is not sent)."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # else every request gets a 400
        raise ValueError(f"--temperature must be a number >= 0, got {args.temperature}")
    temperatures = number_mix(args.temperatures, "--temperatures", "0,0.7,1") if args.temperatures \
        else [args.temperature]
    penalties = number_mix(args.presence_penalties, "--presence-penalties", "0,0.5") \
        if args.presence_penalties else [0.0]
    ngram_sizes = number_mix(args.no_repeat_ngram_sizes, "--no-repeat-ngram-sizes", "0,3") \
        if args.no_repeat_ngram_sizes else [0.0]
    if any(n != int(n) for n in ngram_sizes):
        raise ValueError(f"--no-repeat-ngram-sizes takes whole numbers, e.g. 0,3; got {args.no_repeat_ngram_sizes!r}")
    fields = []
    for i, n in enumerate(lengths):
        own = {"max_tokens": n, "temperature": temperatures[i % len(temperatures)]}
        if args.fixed_length:
            own["min_tokens"] = n
        if penalties[i % len(penalties)]:
            own["presence_penalty"] = penalties[i % len(penalties)]
        if ngram_sizes[i % len(ngram_sizes)]:
            own["no_repeat_ngram_size"] = int(ngram_sizes[i % len(ngram_sizes)])
        if args.distinct_stops:
            own["stop"] = [f"<|stop-{i}|>"]
        if args.distinct_biases:
            own["logit_bias"] = {str(1 + i % BIASED_IDS): -100}
        fields.append(own)
    return fields


def load_prompts(path: str, categories: list[str] | None) -> list[tuple[str, dict]]:
    """(id, request fields) per prompt: text and token ids go to completions, chats to chat."""
    prompts = [p for group in by_category(read_prompts(path)[0], categories).values() for p in group
               if p.turns is None or len(p.turns) == 1]  # a Spec-Bench question's later turn needs a reply
    rows = []
    for p in prompts:
        if p.messages is not None:
            rows.append((p.id, {"messages": p.messages, **({"tools": p.tools} if p.tools else {})}))
        else:
            rows.append((p.id, {"prompt": p.input_ids if p.input_ids is not None else p.text}))
    if not rows:
        raise ValueError(f"prompt file '{path}' has no prompts to send")
    return rows


def _request(url: str, body: dict | None, api_key: str | None) -> urllib.request.Request:
    """A POST of `body` as JSON, or a GET when body is None, with the key when there is one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if body is None:
        return urllib.request.Request(url, headers=headers)
    return urllib.request.Request(url, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json", **headers})


def served_model(base: str, api_key: str | None) -> str:
    """The first model GET /models lists; a server that cannot be reached, or a URL that is not an
    OpenAI API's root, is named with the fix before any load is sent."""
    try:
        with urllib.request.urlopen(_request(base + "/models", None, api_key), timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ValueError(f"{base}/models answered HTTP {e.code}: the server wants an API key; "
                             "give it with --api-key") from None
        raise ValueError(f"{base}/models answered HTTP {e.code}: --url must be the API's root, "
                         "the part before /completions (e.g. http://127.0.0.1:8000/v1)") from None
    except urllib.error.URLError as e:
        raise ValueError(f"could not reach {base} ({e.reason}): is the server running? "
                         "(start one with draftsman serve --target DIR --port PORT)") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{base}/models did not answer an OpenAI model list (data: [{{id: ...}}]): "
                         "is --url an OpenAI-compatible API's root? Or name the model with --model") from None


class BadAnswer(ValueError):
    """A 200 answer that says the request failed (an error event) or that cannot be counted (no
    usage, not JSON): the request counts as failed, with what was wrong."""


def send(base: str, prompt_id: str, fields: dict, settings: dict, stream: bool, api_key: str | None) -> Result:
    chat = "messages" in fields
    body = {**fields, **settings}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(_request(base + ("/chat/completions" if chat else "/completions"), body,
                                             api_key), timeout=600) as r:
            # --fixed-length sends min_tokens: a shorter answer is then checked for why
            min_tokens = body.get("min_tokens")
            got = read_stream(r, chat, t0, min_tokens) if stream else read_answer(r.read(), min_tokens)
    except urllib.error.HTTPError as e:
        return Result(prompt_id, False, f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:  # (a body cut short: IncompleteRead)
        return Result(prompt_id, False, f"{type(e).__name__}: {e}")
    except BadAnswer as e:
        return Result(prompt_id, False, str(e))
    return Result(prompt_id, True, seconds=time.perf_counter() - t0, **got)


def read_answer(raw: bytes, min_tokens: int | None = None) -> dict:
    """A non-streamed answer's Result fields: its output tokens from its usage, and tau."""
    try:
        answer = json.loads(raw)
    except ValueError:  # (UnicodeDecodeError is one too)
        raise BadAnswer(f"the server's answer is not JSON: {_excerpt(raw)} "
                        "(is --url an OpenAI-compatible API's root?)") from None
    if not isinstance(answer, dict):
        raise BadAnswer(f"the server's answer is not a JSON object: {_excerpt(raw)}")
    if "error" in answer:
        raise BadAnswer(f"the server answered 200 with an error: {error_message(answer['error'])}")
    tokens = completion_tokens(answer, raw)
    check_finish(finish_reasons(answer), tokens, min_tokens)
    return {"output_tokens": tokens, "tau": _tau(answer, None)}


def read_stream(lines, chat: bool, t0: float, min_tokens: int | None = None) -> dict:
    """A stream's Result fields: when its pieces of text came (seconds since t0), and its output
    tokens from the usage event that stream_options.include_usage asks for."""
    first, gaps, last, tokens, tau, reasons = None, [], 0.0, None, None, []
    for line in lines:
        line = line.decode(errors="replace").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = _event(line[len("data: "):])
        if "error" in event:  # how draftsman serve (and vLLM) fail once the 200 has gone out
            raise BadAnswer(f"the stream ended in an error: {error_message(event['error'])}")
        if _event_text(event, chat):
            now = time.perf_counter() - t0
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
        if event.get("usage"):
            tokens = completion_tokens(event, line)
        reasons += finish_reasons(event)
        tau = _tau(event, tau)
    if tokens is None:  # 0 tokens would pass for a completed request and lower the throughput
        raise BadAnswer("the stream has no usage event, so its output tokens cannot be counted: the server "
                        "ignored stream_options.include_usage (run without --stream to count them)")
    check_finish(reasons, tokens, min_tokens)
    return {"first_token_seconds": first, "gaps": gaps, "output_tokens": tokens, "tau": tau}


def finish_reasons(answer: dict) -> list[str]:
    """The finish reasons an answer's (or a stream event's) choices give; a stream's pieces give none."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return []
    return [c["finish_reason"] for c in choices if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]


def check_finish(reasons: list[str], tokens: int, min_tokens: int | None) -> None:
    """Raises BadAnswer for an answer that ended but did not complete: one the server aborted (its
    shutdown ends running requests with finish_reason "abort" and their partial tokens), or, with
    --fixed-length, one shorter than its min_tokens for a reason other than "length" (the context
    ran out). Counted as completed, either would pass its few tokens off as a whole request's."""
    if "abort" in reasons:
        raise BadAnswer(f"the server aborted the request (finish_reason abort) after {tokens} tokens")
    if min_tokens is not None and tokens < min_tokens and "length" not in reasons:
        why = ", ".join(reasons) or "none given"
        raise BadAnswer(f"--fixed-length asked for {min_tokens} tokens (min_tokens) but the request ended after "
                        f"{tokens} (finish_reason {why}): does the server honour min_tokens?")


def _event(data: str) -> dict:
    try:
        event = json.loads(data)
    except ValueError:
        raise BadAnswer(f"the stream sent an event that is not JSON: {_excerpt(data)}") from None
    if not isinstance(event, dict):
        raise BadAnswer(f"the stream sent an event that is not a JSON object: {_excerpt(data)}")
    return event


def _event_text(event: dict, chat: bool) -> str | None:
    """The text a stream's event adds: a chat chunk's delta content, a completion chunk's text."""
    choice = (event.get("choices") or [{}])[0]
    if not isinstance(choice, dict):
        return None
    return (choice.get("delta") or {}).get("content") if chat else choice.get("text")


def completion_tokens(answer: dict, raw: bytes | str) -> int:
    """The output tokens an answer's (or the last stream event's) usage counts."""
    usage = answer.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise BadAnswer(f"the server's answer has no usage (completion_tokens), so its output tokens cannot be "
                        f"counted: {_excerpt(raw)}")
    return tokens


def error_message(error) -> str:
    """An OpenAI error's message ({"message": ...}), or the error as it came."""
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _tau(answer: dict, default: float | None) -> float | None:
    """draftsman serve's tokens per target pass, where the answer reports it."""
    ours = answer.get("draftsman")
    return ours.get("tau", default) if isinstance(ours, dict) else default


def _excerpt(raw: bytes | str) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return repr(text[:200] + ("..." if len(text) > 200 else ""))


def send_counted(base: str, prompt_id: str, fields: dict, settings: dict, stream: bool,
                 api_key: str | None) -> Result:
    """send, with whatever it raises made a failed request: an exception would end its client
    thread, leaving that client's later requests unsent and their results missing."""
    try:
        return send(base, prompt_id, fields, settings, stream, api_key)
    except Exception as e:  # noqa: BLE001  any fault is one request's, reported in the summary
        return Result(prompt_id, False, f"the request could not be sent or read: {type(e).__name__}: {e}")


def arrival_gaps(requests: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds to wait before each request starts: none without a rate, else a Poisson process's
    exponential gaps (the first request starts at once)."""
    if rate is None:
        return [0.0] * requests
    draw = random.Random(seed)
    return [0.0] + [draw.expovariate(rate) for _ in range(requests - 1)]


def max_token_draws(requests: int, high: int, low: int | None = None, seed: int = 0) -> list[int]:
    """Each request's max_tokens: `high` for all, or drawn uniformly from [low, high]."""
    if low is None:
        return [high] * requests
    if not 1 <= low <= high:
        raise ValueError(f"--max-tokens-min must be in [1, --max-tokens = {high}], got {low}")
    draw = random.Random(f"{seed}:max_tokens")  # apart from the arrival times' draws
    return [draw.randint(low, high) for _ in range(requests)]


def run_load(base: str, prompts: list[tuple[str, dict]], settings: dict | list[dict], requests: int,
             concurrency: int, stream: bool = False, api_key: str | None = None, rate: float | None = None,
             seed: int = 0) -> tuple[list[Result], float]:
    """`requests` requests, prompts in turn: (results in order, wall seconds). settings: the
    request fields besides the prompt, for all, or one dict per request. Without `rate`,
    `concurrency` clients each send their next request when the last one is answered; with it,
    requests start at Poisson times, `concurrency` in flight at most."""
    if isinstance(settings, dict):
        settings = [settings] * requests
    if rate is not None:
        return _run_open_loop(base, prompts, settings, requests, concurrency, stream, api_key, rate, seed)
    results: list[Result | None] = [None] * requests
    next_index, lock = iter(range(requests)), threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            prompt_id, fields = prompts[i % len(prompts)]
            results[i] = send_counted(base, prompt_id, fields, settings[i], stream, api_key)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(min(concurrency, requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def _run_open_loop(base, prompts, settings, requests, concurrency, stream, api_key, rate, seed):
    results: list[Result | None] = [None] * requests
    slots = threading.Semaphore(concurrency)

    def one(i: int) -> None:
        try:
            prompt_id, fields = prompts[i % len(prompts)]
            results[i] = send_counted(base, prompt_id, fields, settings[i], stream, api_key)
        finally:
            slots.release()

    t0, threads = time.perf_counter(), []
    arrival = t0
    for i, gap in enumerate(arrival_gaps(requests, rate, seed)):
        # Sleep to each arrival's own time, not for its gap: oversleeps and thread starts would
        # add up and offer the server less than the rate asked.
        arrival += gap
        time.sleep(max(0.0, arrival - time.perf_counter()))
        slots.acquire()  # at most `concurrency` in flight: a late start waits here
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def summary(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]

    def spread(values: list[float]) -> dict | None:
        if not values:
            return None
        cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {"mean": statistics.mean(values), "median": statistics.median(values), "p99": cuts[98]}

    tokens = sum(r.output_tokens for r in ok)
    firsts = [r.first_token_seconds for r in ok if r.first_token_seconds is not None]
    per_token = [(r.seconds - r.first_token_seconds) / (r.output_tokens - 1) for r in ok
                 if r.first_token_seconds is not None and r.output_tokens > 1]
    taus = [r.tau for r in ok if r.tau is not None]
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "seconds": wall, "requests_per_second": len(ok) / wall if wall else 0.0,
            "output_tokens": tokens, "output_tokens_per_second": tokens / wall if wall else 0.0,
            "latency_seconds": spread([r.seconds for r in ok]), "ttft_seconds": spread(firsts),
            "tpot_seconds": spread(per_token), "itl_seconds": spread([g for r in ok for g in r.gaps]),
            "mean_tau": statistics.mean(taus) if taus else None,
            "first_error": next((r.error for r in results if not r.ok), None)}


def format_summary(s: dict) -> str:
    lines = [f"requests: {s['completed']} of {s['requests']} completed in {s['seconds']:.2f} s",
             f"request throughput: {s['requests_per_second']:.2f} req/s",
             f"output tokens: {s['output_tokens']} ({s['output_tokens_per_second']:.1f} tokens/s)"]
    for key, name, unit in (("latency_seconds", "latency", 1), ("ttft_seconds", "TTFT", 1000),
                            ("tpot_seconds", "TPOT", 1000), ("itl_seconds", "ITL", 1000)):
        if s.get(key):
            label = "s" if unit == 1 else "ms"
            lines.append(f"{name}: mean {s[key]['mean'] * unit:.2f} {label}, median {s[key]['median'] * unit:.2f} "
                         f"{label}, p99 {s[key]['p99'] * unit:.2f} {label}")
    if s["mean_tau"] is not None:
        lines.append(f"tau (draftsman serve): mean {s['mean_tau']:.2f}")
    if s["failed"]:
        lines.append(f"failed: {s['failed']}; the first: {s['first_error']}")
    return "\n".join(lines)


def side_by_side(runs: list[dict]) -> list[dict]:
    """Per server, the median over its runs of each figure, and its tokens/s over the first server's."""
    def median(values) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    rows = []
    for url in dict.fromkeys(r["url"] for r in runs):
        mine = [r["summary"] for r in runs if r["url"] == url]
        rows.append({"url": url, "runs": len(mine),
                     "requests_per_second": median(m["requests_per_second"] for m in mine),
                     "output_tokens_per_second": median(m["output_tokens_per_second"] for m in mine),
                     "latency_mean_seconds": median((m["latency_seconds"] or {}).get("mean") for m in mine),
                     "ttft_mean_seconds": median((m["ttft_seconds"] or {}).get("mean") for m in mine),
                     "itl_p99_seconds": median((m.get("itl_seconds") or {}).get("p99") for m in mine)})
    first = rows[0]["output_tokens_per_second"]
    for row in rows:
        row["tokens_per_second_vs_first"] = row["output_tokens_per_second"] / first if first else None
    return rows


def format_side_by_side(rows: list[dict]) -> str:
    lines = ["| server | runs | req/s | tokens/s | latency mean s | TTFT mean ms | ITL p99 ms | tokens/s vs first |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = f"{r['ttft_mean_seconds'] * 1000:.0f}" if r["ttft_mean_seconds"] is not None else "-"
        itl = f"{r['itl_p99_seconds'] * 1000:.0f}" if r.get("itl_p99_seconds") is not None else "-"
        latency = f"{r['latency_mean_seconds']:.2f}" if r["latency_mean_seconds"] is not None else "-"
        ratio = f"{r['tokens_per_second_vs_first']:.2f}x" if r["tokens_per_second_vs_first"] is not None else "-"
        lines.append(f"| {r['url']} | {r['runs']} | {r['requests_per_second']:.2f} | "
                     f"{r['output_tokens_per_second']:.1f} | {latency} | {ttft} | {itl} | {ratio} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "concurrency", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.request_rate is not None and not args.request_rate > 0:  # (nan too)
        raise ValueError(f"--request-rate must be > 0 requests per second, got {args.request_rate}")
    bases = [url.rstrip("/") for url in args.url]
    for base in bases:
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"--url {base!r} is not an http(s) URL; give the API's root, "
                             "e.g. http://127.0.0.1:8000/v1")
    if args.json_out:  # before the load runs, not after: a path that cannot be written must not cost the run
        if Path(args.json_out).is_dir():
            raise ValueError(f"--json {args.json_out!r} is a folder: give a file's path, "
                             f"e.g. {str(Path(args.json_out) / 'load.json')!r}")
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    lengths = max_token_draws(args.requests, args.max_tokens, args.max_tokens_min, args.seed)
    fields = request_fields(args, lengths)
    prompts = load_prompts(args.prompts, args.categories.split(",") if args.categories else None)
    models = {base: args.model or served_model(base, args.api_key) for base in bases}
    pace = (f"{args.request_rate:g} per second on average, {args.concurrency} in flight at most"
            if args.request_rate is not None else f"{args.concurrency} at a time")
    runs = []
    for repeat in range(args.repeats):
        for base in (bases if repeat % 2 == 0 else bases[::-1]):  # the order flips: drift hits each server alike
            settings = [{"model": models[base], **own} for own in fields]
            results, wall = run_load(base, prompts, settings, args.requests, args.concurrency, args.stream,
                                     args.api_key, args.request_rate, args.seed)
            s = summary(results, wall)
            runs.append({"url": base, "repeat": repeat, "summary": s, "results": [asdict(r) for r in results]})
            most = f"{args.max_tokens_min}-{args.max_tokens}" if args.max_tokens_min else args.max_tokens
            print(f"{args.requests} requests to {base} ({models[base]}), {pace}, {most} tokens at "
                  f"most{', streamed' if args.stream else ''}, temperature {args.temperatures or args.temperature}"
                  + (f", presence_penalty {args.presence_penalties}" if args.presence_penalties else "")
                  + (f", no_repeat_ngram_size {args.no_repeat_ngram_sizes}" if args.no_repeat_ngram_sizes else "")
                  + (", a banned token each" if args.distinct_biases else "")
                  + (f"; run {repeat + 1} of {args.repeats}" if args.repeats > 1 else ""))
            print(format_summary(s) + "\n")
    table = side_by_side(runs) if len(bases) > 1 or args.repeats > 1 else None
    if table:
        print("side by side (medians over runs):\n" + format_side_by_side(table))
    if args.json_out:
        with replaced_whole(args.json_out) as tmp:
            tmp.write_text(json.dumps({"summary": runs[0]["summary"], "results": runs[0]["results"],
                                       "runs": runs, "side_by_side": table}, indent=1))
    return 0 if all(r["summary"]["failed"] == 0 for r in runs) else 1
