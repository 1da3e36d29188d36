"""`draftsman loadtest`: every request is sent and counted, its tokens and timings read from the
server's answers (streamed or not), and failures are reported, not hidden."""
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftsman import cli
from draftsman.loadtest import Result, load_prompts, summary

from serving import ngram_decoder, running


@pytest.fixture(scope="module")
def served(chat_target):
    decoder = ngram_decoder(chat_target[0])
    with running(decoder) as (server, base):
        yield server, decoder, base


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("loadtest") / "prompts.jsonl"
    rows = [{"id": "a", "text": "def parse(text):\n", "category": "code"},
            {"id": "b", "input_ids": [5, 6, 7, 8], "category": "code"},
            {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "category": "chat"},
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_go_to_their_endpoint_and_later_turns_are_left_out(prompt_file):
    rows = load_prompts(str(prompt_file), None)
    assert [i for i, _ in rows] == ["a", "b", "c", "81"]
    assert rows[0][1] == {"prompt": "def parse(text):\n"} and rows[1][1] == {"prompt": [5, 6, 7, 8]}
    assert rows[2][1] == {"messages": [{"role": "user", "content": "Hi"}]}
    assert rows[3][1] == {"messages": [{"role": "user", "content": "Write a poem."}]}
    assert [i for i, _ in load_prompts(str(prompt_file), ["chat"])] == ["c"]


@pytest.mark.parametrize("stream", [False, True])
def test_every_request_is_counted(served, prompt_file, tmp_path, capsys, stream):
    server, decoder, base = served
    out = tmp_path / "load.json"
    argv = ["loadtest", "--url", base + "/v1", "--prompts", str(prompt_file), "--requests", "7", "--concurrency",
            "3", "--max-tokens", "6", "--fixed-length", "--json", str(out)] + (["--stream"] if stream else [])
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "requests: 7 of 7 completed" in printed and "tau (draftsman serve)" in printed
    got = json.loads(out.read_text())
    s, results = got["summary"], got["results"]
    # prompts in turn; every request made exactly 6 tokens (min_tokens = max_tokens)
    assert [r["prompt_id"] for r in results] == ["a", "b", "c", "81", "a", "b", "c"]
    assert s["output_tokens"] == 42 and all(r["output_tokens"] == 6 for r in results)
    assert s["completed"] == 7 and s["failed"] == 0 and s["requests_per_second"] > 0
    if stream:
        assert "TTFT" in printed and all(0 < r["first_token_seconds"] <= r["seconds"] for r in results)
        assert s["tpot_seconds"]["mean"] > 0
        # a gap between each two pieces of a stream, none longer than the stream
        assert "ITL" in printed and all(len(r["gaps"]) >= 1 and sum(r["gaps"]) <= r["seconds"] for r in results)
        assert 0 < s["itl_seconds"]["mean"] <= s["itl_seconds"]["p99"]
    else:
        assert s["ttft_seconds"] is None and "TTFT" not in printed and s["itl_seconds"] is None


def test_failures_are_reported(served, prompt_file, capsys):
    _, _, base = served
    argv = ["loadtest", "--url", base + "/v1", "--prompts", str(prompt_file), "--requests", "2", "--model", "other"]
    assert cli.main(argv) == 1
    printed = capsys.readouterr().out
    assert "requests: 0 of 2 completed" in printed and "HTTP 400" in printed
    assert "model 'other' is not served" in printed
    assert cli.main(["loadtest", "--url", base + "/v1", "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
    assert cli.main(["loadtest", "--url", "http://127.0.0.1:9/v1", "--prompts", str(prompt_file)]) == 2
    assert "error:" in capsys.readouterr().err


@contextmanager
def answering(body: bytes, content_type: str = "application/json"):
    """(base URL, POSTs received) of a server that lists model 'm' and answers every POST 200 with
    `body`: the odd answers a real server gives only when something is wrong."""
    posts = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self._answer(json.dumps({"data": [{"id": "m"}]}).encode(), "application/json")

        def do_POST(self):
            posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._answer(body, content_type)

        def _answer(self, data: bytes, kind: str):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", posts
    finally:
        server.shutdown()
        server.server_close()


# What draftsman serve writes when generation fails after the stream's 200 went out (serve.py).
FAILED_STREAM = (b'data: {"choices": [{"index": 0, "text": "abc", "finish_reason": null}]}\n\n'
                 b'data: {"error": {"message": "generation failed: out of memory", "type": "server_error", '
                 b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n')
NO_USAGE = json.dumps({"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]}).encode()
UNCOUNTED_STREAM = b'data: {"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
# What draftsman serve answers for a running request when it is stopped (SIGTERM) mid-run.
ABORTED = json.dumps({"choices": [{"index": 0, "text": "ab", "finish_reason": "abort"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()
ABORTED_STREAM = (b'data: {"choices": [{"index": 0, "text": "ab", "finish_reason": null}]}\n\n'
                  b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}\n\n'
                  b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
                  b'"total_tokens": 7}}\n\ndata: [DONE]\n\n')


@pytest.mark.parametrize("body, stream, named", [
    (FAILED_STREAM, True, "the stream ended in an error: generation failed: out of memory"),
    (UNCOUNTED_STREAM, True, "the stream has no usage event"),
    (NO_USAGE, False, "the server's answer has no usage (completion_tokens)"),
    (b"<html>oops</html>", False, "the server's answer is not JSON: '<html>oops</html>'"),
    (ABORTED, False, "the server aborted the request (finish_reason abort) after 2 tokens"),
    (ABORTED_STREAM, True, "the server aborted the request (finish_reason abort) after 2 tokens")],
    ids=["error-event", "stream-without-usage", "no-usage", "not-json", "aborted", "aborted-stream"])
def test_an_answer_that_failed_or_cannot_be_counted_is_a_failed_request(prompt_file, capsys, body, stream, named):
    """A stream's error event passed for a completed request of 0 tokens; an answer without usage,
    or not JSON, ended its client thread (its later requests never sent) and crashed the summary;
    a request the server aborted (stopped mid-run) passed for a completed one of its few tokens."""
    with answering(body, "text/event-stream" if stream else "application/json") as (base, posts):
        argv = ["loadtest", "--url", base, "--prompts", str(prompt_file), "--requests", "3", "--concurrency", "1",
                "--max-tokens", "4"] + (["--stream"] if stream else [])
        assert cli.main(argv) == 1
    printed = capsys.readouterr().out
    assert len(posts) == 3  # the one client went on after each failure
    assert "requests: 0 of 3 completed" in printed and f"failed: 3; the first: {named}" in printed


def short_answer(reason: str, stream: bool) -> bytes:
    """An answer of 2 tokens that ended for `reason`."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    if not stream:
        return json.dumps({"choices": [{"index": 0, "text": "ab", "finish_reason": reason}], "usage": usage}).encode()
    events = [{"choices": [{"index": 0, "text": "ab", "finish_reason": reason}]}, {"choices": [], "usage": usage}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
def test_fixed_length_fails_a_request_that_stopped_short(prompt_file, capsys, stream):
    """--fixed-length asks every request for its max_tokens: a 2-token answer that stopped (a server
    ignoring min_tokens) is not the load asked for; one the context cut ("length"), or any that
    stops at EOS without --fixed-length, is completed."""
    argv = ["--prompts", str(prompt_file), "--requests", "2", "--max-tokens", "4"] + (["--stream"] if stream else [])
    kind = "text/event-stream" if stream else "application/json"
    for reason, fixed, completed in [("stop", True, 0), ("length", True, 2), ("stop", False, 2)]:
        with answering(short_answer(reason, stream), kind) as (base, _):
            code = cli.main(["loadtest", "--url", base] + argv + (["--fixed-length"] if fixed else []))
        printed = capsys.readouterr().out
        assert code == (0 if completed == 2 else 1) and f"requests: {completed} of 2 completed" in printed
        if not completed:
            assert ("the first: --fixed-length asked for 4 tokens (min_tokens) but the request ended after 2 "
                    "(finish_reason stop)") in printed


@pytest.mark.parametrize("rate", [None, 1000.0])
def test_a_fault_while_sending_is_a_failed_request_not_a_lost_one(monkeypatch, rate):
    import draftsman.loadtest as L
    sent = []

    def send_that_fails_once(base, prompt_id, fields, settings, stream, api_key):
        sent.append(prompt_id)
        if len(sent) == 1:
            raise RuntimeError("boom")
        return Result(prompt_id, True, seconds=0.01, output_tokens=1)

    monkeypatch.setattr(L, "send", send_that_fails_once)
    results, wall = L.run_load("http://x", [("a", {})], {}, requests=3, concurrency=1, rate=rate)
    assert len(sent) == 3 and [r.ok for r in results] == [False, True, True]
    assert "RuntimeError: boom" in results[0].error
    assert summary(results, wall)["failed"] == 1


def test_a_wrong_url_or_a_missing_key_is_named_before_any_load(served, prompt_file, tmp_path, capsys):
    server, decoder, base = served
    cases = [(base, "--url must be the API's root"),  # /v1 left off
             ("127.0.0.1:8000/v1", "is not an http(s) URL"),
             ("http://127.0.0.1:9/v1", "is the server running?")]
    for url, named in cases:
        assert cli.main(["loadtest", "--url", url, "--prompts", str(prompt_file), "--requests", "2"]) == 2
        captured = capsys.readouterr()
        assert named in captured.err and "requests:" not in captured.out
    with running(decoder, api_key="k") as (_, keyed):
        argv = ["loadtest", "--url", keyed + "/v1", "--prompts", str(prompt_file), "--requests", "1",
                "--max-tokens", "2"]
        assert cli.main(argv) == 2 and "--api-key" in capsys.readouterr().err
        assert cli.main(argv + ["--api-key", "k"]) == 0


def test_json_goes_to_a_new_folder_and_a_bad_one_fails_first(served, prompt_file, tmp_path, capsys):
    _, _, base = served
    argv = ["loadtest", "--url", base + "/v1", "--prompts", str(prompt_file), "--requests", "1", "--max-tokens", "2"]
    out = tmp_path / "runs" / "today" / "load.json"
    assert cli.main(argv + ["--json", str(out)]) == 0
    assert json.loads(out.read_text())["summary"]["completed"] == 1 and list(out.parent.iterdir()) == [out]
    capsys.readouterr()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(argv + ["--json", str(blocker / "load.json")]) == 2
    captured = capsys.readouterr()
    assert "error:" in captured.err and "requests:" not in captured.out  # no load was sent to be lost
    # an existing folder as the file: it failed only when writing, after the whole load ran
    assert cli.main(argv + ["--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"--json '{tmp_path}' is a folder" in captured.err and "requests:" not in captured.out

def test_summary_percentiles_and_per_token_time():
    results = [Result("a", True, seconds=s, first_token_seconds=0.1, output_tokens=11) for s in (1.1, 2.1, 3.1)]
    results.append(Result("b", False, "HTTP 500: boom"))
    s = summary(results, wall=4.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (3, 1, "HTTP 500: boom")
    assert s["output_tokens_per_second"] == pytest.approx(33 / 4)
    assert s["latency_seconds"]["median"] == pytest.approx(2.1)
    assert s["tpot_seconds"]["mean"] == pytest.approx(0.2)  # (2.1 - 0.1) / 10
    assert s["latency_seconds"]["p99"] == pytest.approx(3.08)


def test_clients_send_at_once(monkeypatch):
    import threading
    import time

    import draftsman.loadtest as L
    in_flight, most, lock = [0], [0], threading.Lock()

    def fake_send(base, prompt_id, fields, settings, stream, api_key):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return Result(prompt_id, True, seconds=0.05, output_tokens=1)

    monkeypatch.setattr(L, "send", fake_send)
    results, _ = L.run_load("http://x", [("a", {}), ("b", {})], {}, requests=9, concurrency=3)
    assert most[0] == 3 and [r.prompt_id for r in results] == ["a", "b"] * 4 + ["a"]


def test_fixed_length_sends_min_tokens(monkeypatch, prompt_file, capsys):
    import draftsman.loadtest as L
    sent = []
    monkeypatch.setattr(L, "served_model", lambda base, key: "m")
    monkeypatch.setattr(L, "send", lambda base, pid, fields, settings, stream, key: sent.append(settings) or
                        Result(pid, True, seconds=0.1, output_tokens=5))
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "1",
                     "--max-tokens", "5", "--fixed-length"]) == 0
    assert sent == [{"model": "m", "max_tokens": 5, "temperature": 0.0, "min_tokens": 5}]
    sent.clear()
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "2",
                     "--max-tokens", "5", "--distinct-stops"]) == 0
    assert [s["stop"] for s in sent] == [["<|stop-0|>"], ["<|stop-1|>"]]
    sent.clear()
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "18",
                     "--max-tokens", "5", "--distinct-biases"]) == 0
    assert [s["logit_bias"] for s in sent] == [{str(i): -100} for i in [*range(1, 17), 1, 2]]
    sent.clear()
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "3",
                     "--max-tokens", "5", "--no-repeat-ngram-sizes", "0,3"]) == 0
    assert [s.get("no_repeat_ngram_size") for s in sent] == [None, 3, None]
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file),
                     "--no-repeat-ngram-sizes", "2.5"]) != 0
    assert "--no-repeat-ngram-sizes takes whole numbers, e.g. 0,3" in capsys.readouterr().err
    sent.clear()
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "4",
                     "--max-tokens", "5", "--temperatures", "0,0.7"]) == 0
    assert [s["temperature"] for s in sent] == [0.0, 0.7, 0.0, 0.7]
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--temperatures", "0,hot"]) != 0
    assert "--temperatures takes numbers >= 0 separated by commas" in capsys.readouterr().err
    sent.clear()
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--requests", "3",
                     "--max-tokens", "5", "--presence-penalties", "0,0.5"]) == 0
    assert [s.get("presence_penalty") for s in sent] == [None, 0.5, None]
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file),
                     "--presence-penalties", "-1"]) != 0
    assert "--presence-penalties takes numbers >= 0 separated by commas, e.g. 0,0.5" in capsys.readouterr().err
    # refused here, not sent for the server to refuse each request: a number >= 0 (nan is not one)
    sent.clear()
    for flag, value, named in [("--temperature", "-1", "--temperature must be a number >= 0, got -1.0"),
                               ("--temperature", "nan", "--temperature must be a number >= 0, got nan"),
                               ("--temperatures", "0,nan", "--temperatures takes numbers >= 0"),
                               ("--temperatures", "inf", "--temperatures takes numbers >= 0"),
                               ("--presence-penalties", "nan", "--presence-penalties takes numbers >= 0")]:
        assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), flag, value]) == 2
        assert named in capsys.readouterr().err and sent == []


def test_max_tokens_vary_between_requests_alike_for_every_server(monkeypatch, prompt_file, capsys):
    import draftsman.loadtest as L
    sent = []
    monkeypatch.setattr(L, "served_model", lambda base, key: "m")
    monkeypatch.setattr(L, "send", lambda base, pid, fields, settings, stream, key: sent.append(
        (base, settings)) or Result(pid, True, seconds=0.1, output_tokens=5))
    assert cli.main(["loadtest", "--url", "http://x/v1", "--url", "http://y/v1", "--prompts", str(prompt_file),
                     "--requests", "40", "--concurrency", "1", "--max-tokens", "64", "--max-tokens-min", "8",
                     "--fixed-length", "--seed", "2"]) == 0
    lengths = {base: [s["max_tokens"] for b, s in sent if b == base] for base in ("http://x/v1", "http://y/v1")}
    assert lengths["http://x/v1"] == lengths["http://y/v1"] == L.max_token_draws(40, 64, 8, seed=2)
    assert all(8 <= n <= 64 for n in lengths["http://x/v1"]) and len(set(lengths["http://x/v1"])) > 10
    assert all(s["min_tokens"] == s["max_tokens"] for _, s in sent)
    assert L.max_token_draws(40, 64, 8, seed=3) != L.max_token_draws(40, 64, 8, seed=2)
    assert "8-64 tokens at most" in capsys.readouterr().out
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--max-tokens", "16",
                     "--max-tokens-min", "20"]) == 2
    assert "--max-tokens-min must be in [1, --max-tokens = 16], got 20" in capsys.readouterr().err


def test_request_rate_starts_requests_at_poisson_times(monkeypatch, capsys, prompt_file):
    import threading
    import time
    import types

    import draftsman.loadtest as L
    gaps = L.arrival_gaps(6, rate=20.0, seed=3)
    assert gaps[0] == 0 and gaps == L.arrival_gaps(6, rate=20.0, seed=3) and len(set(gaps)) == 6
    assert L.arrival_gaps(3, None) == [0.0, 0.0, 0.0]
    starts, lock = [], threading.Lock()

    def fake_send(base, prompt_id, fields, settings, stream, api_key):
        with lock:
            starts.append(time.perf_counter())
        time.sleep(0.3)  # longer than the gaps: an open loop does not wait for answers
        return Result(prompt_id, True, seconds=0.3, output_tokens=1)

    monkeypatch.setattr(L, "send", fake_send)
    results, wall = L.run_load("http://x", [("a", {})], {}, requests=6, concurrency=6, rate=20.0, seed=3)
    assert all(r.ok for r in results)
    offsets = [s - starts[0] for s in sorted(starts)]
    want = [sum(gaps[1:i + 1]) for i in range(6)]
    assert all(abs(o - w) < 0.15 for o, w in zip(offsets, want)), (offsets, want)
    assert wall < sum(gaps) + 0.3 + 0.3  # overlapped, not one after another (6 x 0.3 s)
    # A sleep that oversleeps by 60 ms each time (a loaded machine): the starts keep to their
    # times, each at most one oversleep late, rather than drifting by one more each request.
    starts.clear()
    monkeypatch.setattr(L, "time", types.SimpleNamespace(perf_counter=time.perf_counter,
                                                         sleep=lambda s: time.sleep(s + 0.06)))
    L.run_load("http://x", [("a", {})], {}, requests=6, concurrency=6, rate=20.0, seed=3)
    late = [s - starts[0] - w for s, w in zip(sorted(starts), want)]
    assert all(-0.01 < d < 0.06 + 0.1 for d in late), late
    monkeypatch.setattr(L, "time", time)
    # in flight at most `concurrency`: with 1, each start waits for the answer before it
    starts.clear()
    L.run_load("http://x", [("a", {})], {}, requests=3, concurrency=1, rate=1000.0)
    assert all(b - a >= 0.29 for a, b in zip(starts, starts[1:]))
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    assert cli.main(["loadtest", "--url", "http://x/v1", "--prompts", str(prompt_file), "--request-rate", "nan"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err


def test_two_servers_side_by_side(chat_target, prompt_file, tmp_path, capsys):
    import draftsman
    from serving import running

    plain = draftsman.load({"target": {"path": str(chat_target[0])}, "drafter": {"name": "none"}})
    with running(ngram_decoder(chat_target[0])) as (_, first), running(plain) as (_, second):
        first, second = first + "/v1", second + "/v1"
        out = tmp_path / "two.json"
        argv = ["loadtest", "--url", first, "--url", second, "--repeats", "3", "--prompts",
                str(prompt_file), "--requests", "3", "--max-tokens", "4", "--fixed-length", "--json", str(out)]
        assert cli.main(argv) == 0
    got = json.loads(out.read_text())
    # the order flips every run, so drift on the machine hits both servers alike
    assert [r["url"] for r in got["runs"]] == [first, second, second, first, first, second]
    # the top level holds the first run only, as docs/serving.md says: each run's is under "runs"
    assert (got["summary"], got["results"]) == (got["runs"][0]["summary"], got["runs"][0]["results"])
    assert [r["repeat"] for r in got["runs"]] == [0, 0, 1, 1, 2, 2]
    assert all(r["summary"]["output_tokens"] == 12 for r in got["runs"])
    rows = got["side_by_side"]
    assert [r["url"] for r in rows] == [first, second] and [r["runs"] for r in rows] == [3, 3]
    assert rows[0]["tokens_per_second_vs_first"] == 1.0
    for row in rows:
        mine = sorted(r["summary"]["output_tokens_per_second"] for r in got["runs"] if r["url"] == row["url"])
        assert row["output_tokens_per_second"] == mine[1]  # the median of three
    assert rows[1]["tokens_per_second_vs_first"] == pytest.approx(
        rows[1]["output_tokens_per_second"] / rows[0]["output_tokens_per_second"])
    printed = capsys.readouterr().out
    assert "side by side (medians over runs)" in printed and "| 1.00x |" in printed
