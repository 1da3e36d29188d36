"""`draftsman serve` holds a request's output to a grammar: OpenAI's response_format, vLLM's
structured_outputs and guided_* fields. Each answer equals Decoder.generate / chat with the same
structured_output, whole, streamed and batched beside requests with other grammars or none."""
import json

import pytest

from serving import NEW, call, events, ngram_decoder, queue_while_busy, running

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
USER = [{"role": "user", "content": "Is it red?"}]
LONG = 40  # room for the JSON to close


@pytest.fixture(scope="module")
def server(chat_target):
    decoder = ngram_decoder(chat_target[0])
    with running(decoder, max_batch_rows=8) as (server, base):
        yield server, decoder, base


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                                 "strict": True}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     {"json": SCHEMA, "disable_any_whitespace": True}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"guided_regex": "[a-z]{2,6}"}, {"regex": "[a-z]{2,6}"}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_choice": ["red", "green"]}, {"choice": ["red", "green"]}),
    ({"guided_grammar": 'start: "x" "y"*'}, {"grammar": 'start: "x" "y"*'}),
])
def test_chat_and_completions_follow_the_requests_grammar(server, fields, spec):
    _, decoder, base = server
    want = decoder.chat(USER, max_new_tokens=LONG, structured_output=spec)
    status, got = call(base, "/v1/chat/completions", {"messages": USER, "max_tokens": LONG, **fields})
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want.texts[0]
    streamed = events(base, "/v1/chat/completions", {"messages": USER, "max_tokens": LONG, "stream": True, **fields})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]) == want.texts[0]
    if want.stats.finish_reasons[0] != "length" and "json" in spec:
        json.loads(want.texts[0])
    prompt = "def parse(text):\n"
    completion = decoder.generate([prompt], max_new_tokens=LONG, structured_output=spec)
    status, got = call(base, "/v1/completions", {"prompt": prompt, "max_tokens": LONG, **fields})
    assert status == 200 and got["choices"][0]["text"] == completion.texts[0]
    free = decoder.generate([prompt], max_new_tokens=LONG)
    assert free.texts[0] != completion.texts[0]  # the grammar changed the output


def test_a_text_response_format_is_free_text(server):
    _, decoder, base = server
    status, got = call(base, "/v1/completions", {"prompt": "x = ", "max_tokens": NEW,
                                                 "response_format": {"type": "text"}})
    assert status == 200 and got["choices"][0]["text"] == decoder.generate(["x = "], max_new_tokens=NEW).texts[0]


def test_requests_with_other_grammars_share_a_batch(server):
    server, decoder, base = server
    specs = [{"structured_outputs": {"choice": ["yes", "no"]}}, {}, {"guided_regex": "[a-z]{2,6}"},
             {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}]
    wants = [{"choice": ["yes", "no"]}, None, {"regex": "[a-z]{2,6}"}, {"json": SCHEMA}]
    bodies = [{"prompt": "def parse(text):\n", "max_tokens": LONG, **spec} for spec in specs]
    answers = queue_while_busy(server, base, bodies)
    assert all(status == 200 for status, _ in answers), answers
    assert [got["draftsman"]["batch_rows"] for _, got in answers] == [4, 4, 4, 4]
    for want, (_, got) in zip(wants, answers):
        alone = decoder.generate(["def parse(text):\n"], max_new_tokens=LONG, structured_output=want)
        assert got["choices"][0]["text"] == alone.texts[0], want


@pytest.mark.parametrize("fields, message", [
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "each constrain the output: send one"),
    ({"response_format": {"type": "json_schema"}}, '"response_format" must be'),
    ({"response_format": "json"}, '"response_format" must be'),
    ({"structured_outputs": {"regexp": "a+"}}, '"structured_outputs": structured_output must be a dict with exactly'),
    ({"guided_choice": []}, "non-empty strings"),
    ({"guided_regex": "[0-9"}, "does not compile"),
    ({"guided_regex": "a+", "min_tokens": 2}, "holds EOS back: drop one of them"),
])
def test_bad_structured_requests_get_a_400(server, fields, message):
    _, _, base = server
    status, got = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 4, **fields})
    assert status == 400 and message in got["error"]["message"], got
