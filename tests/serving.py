"""What the `draftsman serve` tests share: a server on a free port in a thread, and a client."""
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

import draftsman
from draftsman.serve import Server

NEW = 12


def ngram_decoder(target_folder):
    return draftsman.load({"target": {"path": str(target_folder)},
                           "drafter": {"name": "ngram", "k": 3, "branches": 2, "min_ngram": 1}})


@contextmanager
def running(decoder, **options):
    """(server, base URL) of a Server for `decoder`, serving in a thread until the block ends."""
    server = Server(decoder, "tiny", "127.0.0.1", 0, quiet=True, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def call(base: str, path: str, body=None, raw: bytes | None = None):
    """(status, parsed JSON) of a GET (body None) or POST."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(base: str, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        lines = [line.decode() for line in r.read().splitlines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def queue_while_busy(server, base: str, bodies: list[dict], paths: list[str] | None = None) -> list:
    """Send the requests one by one while a generation holds the server, each waiting before the
    next is sent (so the arrival order is known), then let them run: [(status, response)], a
    stream's response being its list of events. paths: each request's endpoint (/v1/completions)."""
    answers = [None] * len(bodies)
    paths = paths or ["/v1/completions"] * len(bodies)

    def send(i):
        if not bodies[i].get("stream"):
            answers[i] = call(base, paths[i], bodies[i])
            return
        try:  # a stream: (200, its events), or the error before any event
            answers[i] = (200, events(base, paths[i], bodies[i]))
        except urllib.error.HTTPError as e:
            answers[i] = (e.code, json.loads(e.read()))

    threads = []
    with server.generating:
        for i in range(len(bodies)):
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            deadline = time.time() + 30
            while len(server.batcher.waiting) < i + 1:
                assert time.time() < deadline, "a request never reached the waiting list"
                time.sleep(0.01)
    for t in threads:
        t.join(60)
    return answers


def scrape(base: str) -> dict:
    """GET /metrics as {(sample name, labels as sorted tuple): value}."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# A `draftsman serve` process whose drafter takes 0.2 s a round, as a big target's rounds would.
# (SIGINT restored: a shell starts background jobs with it ignored, and Python then keeps it so)
SLOW_SERVER = """import signal, sys, time
from draftsman.cli import main
signal.signal(signal.SIGINT, signal.default_int_handler)
from draftsman.drafters.{module} import {cls}
propose = {cls}.propose
def slow(self, contexts):
    time.sleep(0.2)
    return propose(self, contexts)
{cls}.propose = slow
sys.exit(main(sys.argv[1:]))
"""


def slow_serve_process(drafter: str, *args: str) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of `draftsman serve ARGS` whose drafter ("module:Class", e.g.
    "ngram:NgramDrafter") takes 0.2 s a round, so a long request still runs when the test stops the
    server. The caller kills the process."""
    module, cls = drafter.split(":")
    server = subprocess.Popen([sys.executable, "-c", SLOW_SERVER.format(module=module, cls=cls), "serve", *args,
                               "--port", "0", "--quiet"], stderr=subprocess.PIPE, text=True)
    line = server.stderr.readline()  # "serving 'NAME' with drafter D at URL (Ctrl-C stops)"
    found = re.search(r"at (http://[^/\s]+)", line)
    if found is None:
        server.kill()
        raise AssertionError(f"the server did not start: {line}{server.stderr.read()}")
    return server, found.group(1)
