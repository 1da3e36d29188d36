"""vLLM's include_stop_str_in_output: a text ended by a stop string keeps it. The tokens, and
where the row ends, are the same either way; only the text's cut moves to the stop's end."""
import pytest

from draftsman.api import JoiningPrompt
from serving import call, ngram_decoder, queue_while_busy, running

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def decoder_and_stop(chat_target):
    """An n-gram decoder, and a stop string its greedy output holds after its first characters."""
    decoder = ngram_decoder(chat_target[0])
    full = decoder.generate(input_ids=[PROMPT], max_new_tokens=24, stop=[], ignore_eos=True).texts[0]
    at = next(i for i in range(4, len(full) - 2) if full[i:i + 2].strip() and full.find(full[i:i + 2]) == i)
    return decoder, full, full[at:at + 2], at


def test_the_text_keeps_the_stop_string_and_the_tokens_are_the_same(decoder_and_stop):
    decoder, full, stop, at = decoder_and_stop
    settings = {"input_ids": [PROMPT, PROMPT], "max_new_tokens": 24, "stop": [stop], "ignore_eos": True}
    cut = decoder.generate(**settings)
    kept = decoder.generate(**settings, include_stop_str_in_output=True)
    both = decoder.generate(**settings, include_stop_str_in_output=[True, False])
    assert cut.texts == [full[:at]] * 2 and kept.texts == [full[:at + len(stop)]] * 2
    assert both.texts == [full[:at + len(stop)], full[:at]]
    assert kept.token_ids == cut.token_ids == both.token_ids and kept.stats.finish_reasons == ["stop"] * 2
    streamed = "".join(decoder.stream(input_ids=PROMPT, max_new_tokens=24, stop=[stop], ignore_eos=True,
                                      include_stop_str_in_output=True))
    assert streamed == full[:at + len(stop)]
    chunks = list(decoder.stream_chunks(input_ids=PROMPT, max_new_tokens=24, stop=[stop], ignore_eos=True,
                                        include_stop_str_in_output=True))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].text == ""  # sent in its round, not held to the end


def test_samples_of_a_prompt_share_its_flag(decoder_and_stop):
    decoder = decoder_and_stop[0]
    stops = list("abcdefghijklmnopqrstuvwxyz0123456789")  # a sampled row soon writes one
    out = decoder.generate(input_ids=[PROMPT, PROMPT], max_new_tokens=24, stop=stops, temperature=1.0, seed=3,
                           num_return_sequences=2, include_stop_str_in_output=[True, False])
    assert out.stats.finish_reasons == ["stop"] * 4
    assert [text[-1:] in stops for text in out.texts] == [True, True, False, False]
    assert not any(stop in text for stop in stops for text in out.texts[2:])


def test_a_joining_row_keeps_its_own_flag(decoder_and_stop):
    decoder, full, stop, at = decoder_and_stop
    pending = [[JoiningPrompt(PROMPT), JoiningPrompt(PROMPT, include_stop_str_in_output=False)]]
    shown = {}
    joining = lambda: pending.pop() if pending else []  # noqa: E731
    for row, chunk in decoder.stream_batch([PROMPT], max_new_tokens=24, stop=[stop], ignore_eos=True,
                                           include_stop_str_in_output=True, joining=joining):
        shown[row] = shown.get(row, "") + chunk.text
    assert shown == {0: full[:at + len(stop)], 1: full[:at + len(stop)], 2: full[:at]}


def test_bad_flags_are_named(decoder_and_stop):
    decoder = decoder_and_stop[0]
    with pytest.raises(ValueError, match=r"include_stop_str_in_output takes true or false, or a list of one per "
                                         r"prompt \(1\), got 'yes'"):
        decoder.generate(input_ids=[PROMPT], max_new_tokens=2, include_stop_str_in_output="yes")
    with pytest.raises(ValueError, match="include_stop_str_in_output takes true or false"):
        decoder.check_join([PROMPT], include_stop_str_in_output=1)


def test_requests_with_and_without_it_share_a_serve_batch(decoder_and_stop):
    decoder, full, stop, at = decoder_and_stop
    body = {"prompt": PROMPT, "max_tokens": 24, "stop": [stop], "ignore_eos": True}
    with running(decoder) as (server, base):
        answers = queue_while_busy(server, base, [{**body, "include_stop_str_in_output": True}, body,
                                                  {**body, "include_stop_str_in_output": True, "stream": True}])
        status, bad = call(base, "/v1/completions", {**body, "include_stop_str_in_output": "yes"})
    (s0, kept), (s1, cut), (s2, streamed) = answers
    assert (s0, s1, s2) == (200, 200, 200)
    assert kept["choices"][0]["text"] == full[:at + len(stop)] and cut["choices"][0]["text"] == full[:at]
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == full[:at + len(stop)]
    assert kept["draftsman"]["batch_rows"] == 3  # one batch
    assert status == 400 and "include_stop_str_in_output takes true or false" in bad["error"]["message"]


def test_a_request_that_joins_a_served_batch_keeps_its_own_flag(decoder_and_stop):
    """The batcher: a request without the flag joins a batch whose row has it, and its text is
    still cut before the stop."""
    import threading

    from draftsman.serve_batch import Batcher
    from test_continuous_batching import hold_until_joined

    decoder, full, stop, at = decoder_and_stop
    batcher = Batcher(decoder, threading.Lock(), max_rows=4)
    job, chunks = batcher.stream([PROMPT], {"max_new_tokens": 40, "include_stop_str_in_output": True})
    next(chunks)
    hold_until_joined(batcher, decoder, job)
    out, rows = batcher.generate([PROMPT], {"max_new_tokens": 24, "stop": [stop], "ignore_eos": True})
    assert rows == 2 and out.texts == [full[:at]]
    list(chunks)
