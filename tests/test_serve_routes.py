"""vLLM's /tokenize and /detokenize, and --api-key: the /v1 routes answer only with the key,
health, metrics and the token routes stay open, as vLLM's do."""
import json
import urllib.error
import urllib.request

import pytest

from draftsman import cli

from serving import NEW, call, ngram_decoder, running

USER = [{"role": "user", "content": "def parse(text):"}]


@pytest.fixture(scope="module")
def keyed(chat_target):
    decoder = ngram_decoder(chat_target[0])
    with running(decoder, api_key="s3cret") as (_, base):
        yield decoder, base


def post_with_key(base: str, path: str, body: dict, key: str | None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_as_the_endpoints_encode(keyed):
    decoder, base = keyed
    status, got = call(base, "/tokenize", {"prompt": "def parse(text):\n"})
    assert status == 200 and got["tokens"] == decoder.encode(["def parse(text):\n"])[0]
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == decoder.engine.max_context
    _, plain = call(base, "/tokenize", {"prompt": "def parse(text):\n", "add_special_tokens": False})
    assert plain["tokens"] == decoder.tokenizer("def parse(text):\n", add_special_tokens=False)["input_ids"]
    assert plain["tokens"] != got["tokens"]  # this tokenizer adds a BOS
    _, chat = call(base, "/tokenize", {"messages": USER})
    assert chat["tokens"] == decoder.encode_chat(USER)[0]
    assert call(base, "/detokenize", {"tokens": plain["tokens"]}) == (200, {"prompt": "def parse(text):\n"})


@pytest.mark.parametrize("path, body, message", [
    ("/tokenize", {}, '/tokenize takes "prompt" (text) or "messages"'),
    ("/tokenize", {"prompt": "x", "messages": USER}, '/tokenize takes "prompt" (text) or "messages"'),
    ("/tokenize", {"prompt": 5}, '"prompt" must be a string'),
    ("/tokenize", {"prompt": "x", "promt": "y"}, "/tokenize does not take ['promt']"),
    ("/detokenize", {"tokens": "12"}, '"tokens" must be a list of token ids'),
    ("/detokenize", {"tokens": [1, 10**9]}, "outside the target's vocabulary"),
])
def test_bad_token_requests(keyed, path, body, message):
    _, base = keyed
    status, got = call(base, path, body)
    assert status == 400 and message in got["error"]["message"], got


def test_the_v1_routes_need_the_key(keyed):
    decoder, base = keyed
    body = {"prompt": "x = [", "max_tokens": NEW}
    for key in (None, "wrong", "caf\xe9"):  # (a non-ASCII byte dropped the connection unanswered)
        status, got = post_with_key(base, "/v1/completions", body, key)
        assert status == 401 and got["error"]["type"] == "authentication_error"
        assert "Authorization: Bearer <key>" in got["error"]["message"]
    status, got = post_with_key(base, "/v1/completions", body, "s3cret")
    assert status == 200 and got["choices"][0]["text"] == decoder.generate(["x = ["], max_new_tokens=NEW).texts[0]
    request = urllib.request.Request(base + "/v1/models")
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(request, timeout=30)
    assert call(base, "/health") == (200, {"status": "ok"})
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        assert r.status == 200


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DRAFTSMAN_API_KEY", "from-env")
    args = cli.build_parser().parse_args(["serve", "--config", "x.yaml"])
    assert args.api_key == "from-env"
    assert cli.build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
