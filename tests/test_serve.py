"""`draftsman serve`: the OpenAI API over one Decoder. Responses equal Decoder.generate / chat for
the same settings (greedy, seeded sampling, batches, token-id prompts); streams join to the same
text; OpenAI's field names map to ours; bad requests get a 400 that names the fix."""

import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from draftsman import cli, serve, serve_batch

from serving import NEW, call, events, slow_serve_process

USER = [{"role": "user", "content": "def parse(text):"}]


def test_models_and_health(served):
    _, base = served
    assert call(base, "/health") == (200, {"status": "ok"})
    status, got = call(base, "/v1/models")
    assert status == 200 and [m["id"] for m in got["data"]] == ["tiny"]


def test_completions_equal_generate_greedy_batched_and_by_token_ids(served):
    decoder, base = served
    prompts = ["def parse(text):\n", "import os\nimport"]
    want = decoder.generate(prompts, max_new_tokens=NEW)
    status, got = call(base, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": NEW})
    assert status == 200 and got["object"] == "text_completion"
    assert [c["text"] for c in got["choices"]] == want.texts and [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in got["choices"]] == [
        {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}[r] for r in want.stats.finish_reasons]
    ids = decoder.encode(prompts)
    assert got["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": sum(map(len, want.token_ids)),
                            "total_tokens": sum(map(len, ids)) + sum(map(len, want.token_ids))}
    assert got["draftsman"] == {"drafter": "ngram", "tau": round(want.stats.tau, 4), "lossy": False, "batch_rows": 2}
    status, by_ids = call(base, "/v1/completions", {"prompt": ids[0], "max_tokens": NEW})
    assert by_ids["choices"][0]["text"] == want.texts[0]


def test_sampling_fields_map_to_ours(served):
    decoder, base = served
    settings = dict(temperature=0.9, top_p=0.95, top_k=40, seed=7, presence_penalty=0.3, stop=["\n\n"])
    want = decoder.generate(["class Foo:\n"], max_new_tokens=NEW, num_return_sequences=2, logit_bias={5: 2.0},
                            min_new_tokens=2, **settings)
    status, got = call(base, "/v1/completions", {"prompt": "class Foo:\n", "max_tokens": NEW, "n": 2, "min_tokens": 2,
                                                 "logit_bias": {"5": 2.0}, **settings})
    assert status == 200 and [c["text"] for c in got["choices"]] == want.texts
    one_stop = decoder.generate(["class Foo:\n"], max_new_tokens=NEW, stop=["\n"], temperature=0)
    _, got = call(base, "/v1/completions", {"prompt": "class Foo:\n", "max_tokens": NEW, "stop": "\n",
                                            "temperature": 0})
    assert got["choices"][0]["text"] == one_stop.texts[0]  # OpenAI's stop may be one string
    eos = decoder.tokenizer.eos_token_id
    _, got = call(base, "/v1/completions", {"prompt": "class Foo:\n", "max_tokens": NEW, "logit_bias": {eos: 100}})
    assert got["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}  # ended at EOS
    assert got["usage"]["completion_tokens"] == 1



def test_a_long_stop_at_the_reply_start_is_held_back_whole_and_streamed(served):
    """The stop's first characters are the reply's: none of them reaches the client, in the whole
    answer (built from the stream's pieces) or in the stream."""
    decoder, base = served
    prompt = "def parse(text):\n"
    text = decoder.generate(prompt, max_new_tokens=NEW).texts[0]
    assert len(text) >= 10, f"the reply is too short for the test: {text!r}"
    stop = text[:10]
    _, got = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "stop": stop})
    assert got["choices"][0]["text"] == "" and got["choices"][0]["finish_reason"] == "stop"
    chunks = events(base, "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == ""

def test_chat_equals_decoder_chat_and_streams_join_to_the_same_text(served):
    decoder, base = served
    want = decoder.chat(USER, max_new_tokens=NEW).texts[0]
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "max_completion_tokens": NEW})
    assert status == 200 and got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want}

    chunks = events(base, "/v1/chat/completions", {"messages": USER, "max_tokens": NEW, "stream": True})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and chunks[-1]["draftsman"]["drafter"]

    want = decoder.generate("def parse(text):\n", max_new_tokens=NEW)
    chunks = events(base, "/v1/completions", {"prompt": "def parse(text):\n", "max_tokens": NEW, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want.texts[0] and len(chunks) > 2
    prompt_tokens = len(decoder.encode(["def parse(text):\n"])[0])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens, "completion_tokens": len(want.token_ids[0]),
        "total_tokens": prompt_tokens + len(want.token_ids[0])}
    assert all("usage" not in c for c in chunks[:-1])


def test_only_the_last_event_carries_the_statistics_however_late_the_reader(served, monkeypatch):
    """The batch's statistics are set by the generating thread once every row has ended; a reader
    still sending earlier rows' ends then must not attach them there (CI caught this by chance).
    Here the reader takes each row's end only after all rows have ended, every time."""
    decoder, base = served
    original = serve_batch.Batcher._next

    def late_reader(self, job, gone):
        kind, item = original(self, job, gone)
        if kind == "chunk" and item[1].finish_reason is not None:
            deadline = time.monotonic() + 30
            while job.stats is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert job.stats is not None
        return kind, item

    monkeypatch.setattr(serve_batch.Batcher, "_next", late_reader)
    body = {"prompt": ["def parse(text):\n", "x = ["], "max_tokens": NEW, "temperature": 1.0, "n": 2, "seed": 4,
            "stream": True}
    chunks = events(base, "/v1/completions", body)
    ends = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(ends) == 4 and chunks[-1] is ends[-1]
    assert [("draftsman" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    chat = events(base, "/v1/chat/completions", {"messages": USER, "max_tokens": NEW, "temperature": 1.0, "n": 2,
                                                 "seed": 5, "stream": True})
    assert [("draftsman" in c) for c in chat] == [False] * (len(chat) - 1) + [True]


def test_several_prompts_and_samples_stream_as_indexed_choices(served):
    """OpenAI's streams with n > 1 or several prompts: each event holds one choice, its index
    that of the answer's choices (prompt x n + sample); each choice ends with its own finish_reason
    and its pieces join to that choice of the answer; the last event carries the statistics."""
    decoder, base = served
    prompts = ["def parse(text):\n", "x = ["]
    body = {"prompt": prompts, "max_tokens": NEW, "temperature": 1.0, "n": 2, "seed": 4, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(base, "/v1/completions", body)
    want = decoder.generate(prompts, max_new_tokens=NEW, temperature=1.0, num_return_sequences=2, seed=4,
                            logprobs=True)
    choices = [c["choices"][0] for c in chunks[:-1]]
    for index in range(4):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["text"] for c in mine) == want.texts[index], index
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [
            {"eos": "stop", "length": "length"}[want.stats.finish_reasons[index]]]
        assert mine[-1]["finish_reason"] is not None  # nothing of a choice after its end
        scored = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert scored == pytest.approx(want.logprobs[index], abs=1e-5)
        pieces = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets == [sum(map(len, pieces[:i])) for i in range(len(pieces))]  # each choice's own text
    assert len(set(want.texts)) == 4  # four different samples: the indexes are not interchangeable
    assert [("draftsman" in c) for c in chunks[:-1]] == [False] * (len(chunks) - 2) + [True]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(map(len, want.token_ids))
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, decoder.encode(prompts)))

    chat = events(base, "/v1/chat/completions", {"messages": USER, "max_tokens": NEW, "temperature": 1.0, "n": 2,
                                                 "seed": 5, "stream": True})
    want = decoder.chat(USER, max_new_tokens=NEW, temperature=1.0, num_return_sequences=2, seed=5)
    assert [c["choices"][0] for c in chat[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in (0, 1)]
    for index in (0, 1):
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat
                       if c["choices"][0]["index"] == index) == want.texts[index]


def test_logprobs_are_the_targets_in_openais_shapes(served):
    decoder, base = served
    want = decoder.generate(["def parse(text):\n"], max_new_tokens=NEW, logprobs=True, top_logprobs=2)
    pieces = [decoder.decode_token(t) for t in want.token_ids[0]]
    _, got = call(base, "/v1/completions", {"prompt": "def parse(text):\n", "max_tokens": NEW, "logprobs": 2})
    scores = got["choices"][0]["logprobs"]
    assert scores["tokens"] == pieces and scores["token_logprobs"] == want.logprobs[0]
    expected = []
    for top in want.top_logprobs[0]:  # two byte tokens may both read "\ufffd": the likelier one keeps the key
        expected.append({})
        for t, v in top:
            expected[-1].setdefault(decoder.decode_token(t), v)
    assert scores["top_logprobs"] == expected
    assert any(len(d) < 2 for d in expected)  # such a position is in this output (the last-wins bug showed there)
    assert scores["text_offset"] == [sum(map(len, pieces[:i])) for i in range(len(pieces))]

    want = decoder.chat(USER, max_new_tokens=NEW, logprobs=True, top_logprobs=3)
    _, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": NEW, "logprobs": True,
                                                 "top_logprobs": 3})
    content = got["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == want.logprobs[0]
    assert [c["token"] for c in content] == [decoder.decode_token(t) for t in want.token_ids[0]]
    assert [[(a["token"], a["logprob"]) for a in c["top_logprobs"]] for c in content] == [
        [(decoder.decode_token(t), v) for t, v in top] for top in want.top_logprobs[0]]
    _, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": NEW})
    assert got["choices"][0]["logprobs"] is None


def test_vllm_clients_top_k_minus_1_is_served(served):
    """top_k -1 is vLLM's "every token"; it was refused with a 400."""
    _, base = served
    status, got = call(base, "/v1/completions", {"prompt": "a", "top_k": -1, "temperature": 1, "max_tokens": 3})
    assert status == 200 and got["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"messages": USER, "logprobs": 3}, '"logprobs" is true or false for chat'),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "max_completion_tokens": 3}, "not both"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, '"top_logprobs" needs "logprobs": true'),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "in [0, 20], got 21"),
    ("/v1/completions", {"prompt": "a", "max_token": 3}, "does not take ['max_token']; valid fields: ["),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, "model 'gpt-4' is not served here; this server serves "
                                                           "'tiny'"),
    ("/v1/completions", {"prompt": ["a", []]}, "prompt 1 is empty: give at least one token"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt 0 has token ids [99999] outside the target's vocabulary"),
    ("/v1/completions", {"prompt": "a" * 3000}, "leaving no room to generate"),
    ("/v1/completions", {"prompt": {"text": "a"}}, '"prompt" must be a string, a list of strings'),
    ("/v1/completions", {"prompt": "a", "logit_bias": [1, 2]}, '"logit_bias" must map token ids to biases'),
    ("/v1/completions", {"prompt": "a", "n": 2, "stream": True}, "num_return_sequences=2 at temperature 0"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "num_return_sequences=2 at temperature 0"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": "a", "temperature": "0.7"}, "temperature must be a number, got '0.7' (str)"),
    ("/v1/completions", {"prompt": "a", "temperature": 1, "seed": "7"}, "seed must be a whole number"),
    ("/v1/completions", {"prompt": "a", "temperature": 1, "seed": 2**70}, "seed must be in [-2^63, 2^64)"),
    # n 0 and -1 were answered "no prompts given", "2" and 1.5 with a Python TypeError, true ran as 1
    ("/v1/completions", {"prompt": "a", "n": 0}, '"n" must be a whole number >= 1 (the samples per prompt), got 0'),
    ("/v1/completions", {"prompt": "a", "n": "2", "temperature": 1}, '"n" must be a whole number >= 1'),
    ("/v1/completions", {"prompt": "a", "n": True, "temperature": 1}, '"n" must be a whole number >= 1'),
    ("/v1/chat/completions", {"messages": USER, "n": -1, "temperature": 1}, '"n" must be a whole number >= 1'),
    ("/v1/chat/completions", {"messages": []}, '"messages" is []'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "text": "hi"}]}, "message 0 ('user') has no 'content'"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"usage": True}}, '"stream_options" takes'),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 'goes with "stream": true'),
    # "false" (a string) was truthy: the client got server-sent events where it waited for one object
    ("/v1/completions", {"prompt": "a", "stream": "false"}, '"stream" must be true or false, got "false"'),
    ("/v1/chat/completions", {"messages": USER, "stream": 1}, '"stream" must be true or false, got 1'),
    ("/v1/completions", {"prompt": "a", "stream": "yes", "echo": True}, '"stream" must be true or false'),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "never reads"),
    # A null bias named no field (float()'s words); true was a bias of 1.0.
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": None}}, '"logit_bias" must map token ids to biases (num'),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": True}}, '"logit_bias" must map token ids to biases (num'),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, '"logit_bias" keys must be token ids'),
    # The Python API's one-value-per-prompt lists: [null] stopped nothing, silently.
    ("/v1/completions", {"prompt": "a", "stop": [None]}, '"stop" must be a string or a list of strings, got [null]'),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [None]}, '"stop_token_ids" must be a list of token ids'),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": [2, 3]}, '"max_tokens" takes one value for the whole'),
    ("/v1/completions", {"prompt": ["a", "b\ud800"]}, "prompt 1 is not valid Unicode text: character 1 is '\\ud800'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc80"}]}, "message 0's content is not valid"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tokenizer": None}},
     "['tokenizer'] are set by apply_chat_template itself"),
])
def test_bad_requests_get_a_400_naming_the_fix(served, path, body, message):
    _, base = served
    status, got = call(base, path, body)
    assert status == 400 and got["error"]["type"] == "invalid_request_error"
    assert message in got["error"]["message"]


def test_a_null_max_completion_tokens_is_not_given(served):
    """(it counted as given: 'give "max_completion_tokens" or "max_tokens", not both')"""
    status, got = call(served[1], "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
                                                             "max_completion_tokens": None})
    assert status == 200 and got["usage"]["completion_tokens"] == 2, got


def test_bad_bodies_and_routes(served):
    _, base = served
    status, got = call(base, "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in got["error"]["message"]
    status, got = call(base, "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "must be a JSON object, got list" in got["error"]["message"]
    status, got = call(base, "/v1/embeddings", {"input": "a"})
    assert status == 404 and "/v1/completions" in got["error"]["message"]
    status, got = call(base, "/nothing")  # (a GET listed the GET routes only)
    assert status == 404 and "GET /v1/models, /metrics, /health; POST /v1/completions" in got["error"]["message"]
    # A route asked with the wrong method: 405 naming the one it takes (a GET of /v1/completions
    # was 'no route'; PUT and DELETE were http.server's HTML page)
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET"),
                                  ("DELETE", "/v1/models", "GET"), ("PUT", "/v1/chat/completions", "POST")):
        request = urllib.request.Request(base.removesuffix("/v1") + path, method=method,
                                         data=b"{}" if method != "GET" else None)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=60)
        got = json.loads(e.value.read())
        assert e.value.code == 405 and e.value.headers["Allow"] == allowed, (method, path)
        assert got["error"]["message"] == f"{path} takes {allowed}, not {method}"
    request = urllib.request.Request(base + "/nowhere", method="PATCH", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 404 and "GET /v1/models" in json.loads(e.value.read())["error"]["message"]


def raw_request(base: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    """(status, headers, body bytes) of one request written as given (framing headers included)."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders(body or None)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def test_query_strings_head_options_and_body_framing(served):
    """Clients add query strings (Azure's ?api-version=); HEAD and OPTIONS got http.server's 501 HTML
    page; Content-Length -1 hung the request, "abc" named int()'s words; a chunked body was read as
    none; JSON nested 100000 deep was a 500."""
    decoder, base = served
    status, got = call(base, "/v1/completions?api-version=2024-02-01", {"prompt": "a", "max_tokens": 2})
    assert status == 200 and got["usage"]["completion_tokens"] == 2
    assert call(base, "/health?probe=1") == (200, {"status": "ok"})
    with socket.create_connection((urlsplit(base).hostname, urlsplit(base).port), timeout=60) as connection:
        connection.sendall(b"HEAD /health HTTP/1.0\r\n\r\n")  # (http.client would not read a body after HEAD)
        answer = b"".join(iter(lambda: connection.recv(4096), b""))
    head, _, data = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and data == b"", answer
    assert b"Content-Length: %d" % len(b'{"status": "ok"}') in head
    status, headers, data = raw_request(base, "OPTIONS", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST" and json.loads(data)["error"]["code"] == 405
    body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    for length in ("-1", "abc"):
        status, _, data = raw_request(base, "POST", "/v1/completions", body, {"Content-Length": length})
        assert status == 400, data
        assert f"Content-Length must be a whole number of bytes, got '{length}'" in json.loads(data)["error"]["message"]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    status, _, data = raw_request(base, "POST", "/v1/completions", chunked, {"Transfer-Encoding": "chunked"})
    want = decoder.generate(["a"], max_new_tokens=2).texts[0]
    assert status == 200 and json.loads(data)["choices"][0]["text"] == want
    status, got = call(base, "/v1/completions", raw=b"[" * 100000 + b"]" * 100000)
    assert status == 400 and "nests JSON too deeply" in got["error"]["message"]


def test_the_command_checks_its_target_before_serving(capsys):
    assert cli.main(["serve", "--set", "target.path=/no/such/model", "--port", "0"]) == 2
    assert "/no/such/model" in capsys.readouterr().err


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_server_stopped_mid_request_answers_abort_and_exits_cleanly(tiny_models, stop):
    """docker stop / systemd (SIGTERM) or Ctrl-C while rows generate: the process died of SIGABRT
    (exit -6, "terminate called without an active exception"), the plain client got no answer and
    the stream no finish reason nor [DONE]. Now the rows end with "abort" and the exit is 128 + signal."""
    server, base = slow_serve_process("ngram:NgramDrafter", "--drafter", "ngram", "--set",
                                      f"target.path={tiny_models['llama'][0]}")
    answers = {}

    def ask(name, body):
        try:
            answers[name] = (events if body.get("stream") else call)(base, "/v1/completions", body)
        except Exception as e:  # noqa: BLE001 (the defect: the connection dropped)
            answers[name] = e

    try:
        long = {"prompt": "def g(y):", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        clients = [threading.Thread(target=ask, args=(name, {**long, "stream": name == "stream"}))
                   for name in ("stream", "plain")]
        for client in clients:
            client.start()
        deadline = time.monotonic() + 30
        while "num_requests_running 2.0" not in urllib.request.urlopen(base + "/metrics").read().decode():
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.05)
        server.send_signal(stop)
        assert server.wait(timeout=60) == 128 + stop
        for client in clients:
            client.join(30)
        assert "terminate called" not in server.stderr.read()
    finally:
        server.kill()
        server.stderr.close()
    status, plain = answers["plain"]
    assert status == 200 and plain["choices"][0]["finish_reason"] == "abort", answers["plain"]
    assert answers["stream"][-1]["choices"][0]["finish_reason"] == "abort"  # events() checked its [DONE]


def test_the_exit_waits_for_answers_still_being_written(chat_target, monkeypatch):
    """The handler threads are daemons: an exit while one still writes its answer would cut it."""
    from serving import ngram_decoder, running

    post = serve.Handler._post

    def slow_post(self, route):
        time.sleep(0.5)  # (an answer written slowly, after its rows ended)
        post(self, route)

    monkeypatch.setattr(serve.Handler, "_post", slow_post)
    answers = []
    with running(ngram_decoder(chat_target[0])) as (server, base):
        client = threading.Thread(target=lambda: answers.append(call(base, "/v1/completions", {"prompt": "a"})))
        client.start()
        deadline = time.monotonic() + 30
        while not server.answering:
            assert time.monotonic() < deadline, "the request never came"
            time.sleep(0.01)
        server.wait_for_answers(wait=30)
        assert server.answering == 0
        client.join(30)
    assert answers and answers[0][0] == 200


def test_a_defect_of_ours_is_answered_with_a_500_not_a_dropped_connection(served, monkeypatch, capsys):
    """An exception no handler expected (an AttributeError in a forced call's schema) closed the
    connection with no answer; the client now gets a 500 that names it, the log its traceback."""
    def broken(self, body):
        raise AttributeError("'str' object has no attribute 'items'")

    monkeypatch.setattr(serve.Handler, "_completions", broken)
    status, got = call(served[1], "/v1/completions", {"prompt": "a"})
    assert status == 500 and got["error"]["type"] == "server_error"
    assert "(AttributeError: 'str' object has no attribute 'items'); please report it" in got["error"]["message"]
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("path, body, message, param", [
    # The engine's words named max_new_tokens / min_new_tokens, which the client never sent, and
    # read a min_tokens of the wrong type as out of range ("raise max_new_tokens").
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": "1"},
     '"min_tokens" must be a whole number', "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": True}, '"min_tokens" must be a whole number',
     "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": 2.5}, '"min_tokens" must be a whole number',
     "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": 10},
     '"min_tokens" must be in [0, "max_tokens" = 3], got 10: raise "max_tokens" or lower "min_tokens"', "min_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, '"max_tokens" must be a whole number >= 1, got "10"',
     "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0},
     '"max_completion_tokens" must be a whole number >= 1, got 0', "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 2, "min_tokens": 5},
     '"min_tokens" must be in [0, "max_completion_tokens" = 2]', "min_tokens"),
    # OpenAI's "param": the field a message begins by naming.
    ("/v1/completions", {"prompt": "a", "top_logprobs": 2}, "does not take", "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "stream": 1}, '"stream" must be true or false', "stream"),
])
def test_token_count_errors_name_the_requests_field(served, path, body, message, param):
    status, got = call(served[1], path, body)
    assert status == 400 and message in got["error"]["message"], got
    assert got["error"]["param"] == param and "new_tokens" not in got["error"]["message"]


TOOL = {"type": "function", "function": {"name": "w", "parameters": {"type": "object",
                                                                        "properties": {"c": {"type": "string"}}}}}


@pytest.mark.parametrize("body, param", [
    # "param" was null for each: the messages begin with the Python API's bare names, not a quoted field.
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"seed": "x", "temperature": 1}, "seed"),
    ({"n": 2}, "n"),  # num_return_sequences at temperature 0: the request said n
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"foo": 1, "zoo": 2}, "foo"),  # the first unknown field
    ({"model": "nope"}, "model"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
])
def test_errors_name_the_field_the_request_sent(served, body, param):
    status, got = call(served[1], "/v1/chat/completions", {"messages": USER, "max_tokens": 3, **body})
    assert status == 400 and got["error"]["param"] == param, got


def test_error_param_maps_the_python_names_back_to_the_request():
    """(this target's template reads no tools, so tool_choice's own errors are checked here)"""
    param = serve.error_param
    assert param(ValueError("tool_choice names function 'zz', which \"tools\" does not define"),
                 {"tools": [TOOL], "tool_choice": {"function": {"name": "zz"}}}) == "tool_choice"
    assert param(ValueError("max_new_tokens must be >= 1"), {"max_tokens": 0}) == "max_tokens"
    assert param(ValueError("max_new_tokens must be >= 1"), {"max_completion_tokens": 0}) == "max_completion_tokens"
    assert param(ValueError("num_return_sequences=2 at temperature 0"), {"n": 2}) == "n"
    assert param(ValueError("structured_output 'regex ((' does not compile"), {"guided_json": 5}) == "guided_json"
    # not confident: two structured fields, a bare word the request did not send, no field at all
    assert param(ValueError("structured_output 'x' does not compile"), {"guided_json": 5, "guided_regex": "a"}) is None
    assert param(ValueError("stop strings are ..."), {"prompt": "a"}) is None
    assert param(ValueError("the prompt is too long"), {"prompt": "a"}) is None


def test_the_turn_fields_choose_what_the_template_leaves_open(served):
    """vLLM's add_generation_prompt and continue_final_message (assistant prefill), on the chat
    endpoint and /tokenize, as Decoder.encode_chat renders them; both true is refused, as vLLM does."""
    decoder, base = served
    prefill = [*USER, {"role": "assistant", "content": "    return text.split("}]
    tokenizer = decoder.tokenizer
    _, opened = call(base, "/tokenize", {"messages": USER})
    _, closed = call(base, "/tokenize", {"messages": USER, "add_generation_prompt": False})
    assert closed["tokens"] == list(tokenizer.apply_chat_template(USER, add_generation_prompt=False, tokenize=True,
                                                                  return_dict=False))
    assert opened["tokens"] != closed["tokens"] and opened["tokens"][:len(closed["tokens"])] == closed["tokens"]
    body = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    _, continued = call(base, "/tokenize", body)
    assert continued["tokens"] == decoder.encode_chat(prefill, continue_final_message=True)[0]
    status, got = call(base, "/v1/chat/completions", {**body, "max_tokens": 4, "temperature": 0})
    want = decoder.chat(prefill, continue_final_message=True, max_new_tokens=4, temperature=0)
    assert status == 200 and got["choices"][0]["message"]["content"] == want.texts[0]
    for bad, message in [({**body, "add_generation_prompt": True}, "cannot both be true"),
                         ({"messages": USER, "continue_final_message": True}, "must be the assistant's"),
                         ({"messages": USER, "add_generation_prompt": "no"}, '"add_generation_prompt" is true or')]:
        for path in ("/tokenize", "/v1/chat/completions"):
            status, got = call(base, path, bad)
            assert status == 400 and message in got["error"]["message"], (path, got)
