"""Stop strings (draftsman/stop.py): a row ends where plain decoding would have ended it, even when
the stop string completes in the middle of a round of several accepted tokens."""
import json

import pytest

import draftsman
from draftsman import cli
from draftsman.stop import StopStrings

PROMPTS = ["def parse(text):\n", "class Foo:\n", "import os\n", "x = [1, 2"]
NEW = 24


@pytest.fixture(scope="module")
def plain(tiny_models):
    return draftsman.load({"target": {"path": str(tiny_models["llama"][0])}})


@pytest.fixture(scope="module")
def self_drafting(plain, tiny_models):
    """The target drafting for itself: at T=0 every draft is accepted, so each round emits k + 1
    tokens and a stop string usually completes inside a round."""
    return plain.with_drafter({"name": "draft_model", "path": str(tiny_models["llama"][0]), "k": 4})


def first_stop_cut(decoder, tokens, stop):
    """Plain decoding's stop, computed from an unstopped run: the shortest prefix spelling `stop`."""
    for n in range(1, len(tokens) + 1):
        if stop in decoder.decode(tokens[:n]):
            return tokens[:n]
    return tokens


def stop_inside(decoder, out, row, at):
    """A 2-character stop string taken from the middle of a row's text (so it occurs there)."""
    text = out.texts[row]
    assert len(text) > at + 2, f"row {row}'s text is too short for the test: {text!r}"
    return text[at: at + 2]


def test_stop_is_where_plain_decoding_stops(plain, self_drafting):
    full = self_drafting.generate(PROMPTS, max_new_tokens=NEW)
    stop = stop_inside(self_drafting, full, 0, 10)
    got = self_drafting.generate(PROMPTS, max_new_tokens=NEW, stop=[stop])
    want_plain = plain.generate(PROMPTS, max_new_tokens=NEW, stop=[stop])
    cut_mid_round = 0
    for row in range(len(PROMPTS)):
        want = first_stop_cut(self_drafting, full.token_ids[row], stop)
        assert got.token_ids[row] == want == want_plain.token_ids[row]
        assert stop not in got.texts[row]
        stopped = stop in self_drafting.decode(want)
        assert got.stats.finish_reasons[row] == ("stop" if stopped else full.stats.finish_reasons[row])
        if stopped:
            assert got.texts[row] == full.texts[row][: full.texts[row].index(stop)]
            cut_mid_round += len(want) % 5 != 0  # rounds emit 5 tokens here: a cut inside one
    assert got.stats.finish_reasons[0] == "stop"
    assert cut_mid_round > 0, "no stop completed inside a round: the test would not see a bad cut"


def test_sampled_rows_keep_their_tokens_up_to_the_stop(self_drafting):
    """At T > 0 (batch 1, same seed) a stop only cuts: the tokens before it are those of the run
    without it."""
    full = self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW, temperature=1.0, seed=5)
    stop = stop_inside(self_drafting, full, 0, 6)
    got = self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW, temperature=1.0, seed=5, stop=[stop, "never seen"])
    assert got.token_ids[0] == first_stop_cut(self_drafting, full.token_ids[0], stop)
    assert got.stats.finish_reasons == ["stop"]


def test_the_config_stop_applies_and_an_argument_overrides_it(self_drafting):
    full = self_drafting.generate(PROMPTS[:2], max_new_tokens=NEW)
    stop = stop_inside(self_drafting, full, 1, 5)
    configured = self_drafting.with_drafter(self_drafting.config["drafter"])
    configured.config = {**configured.config, "generation": {**configured.config["generation"], "stop": [stop]}}
    assert configured.generate(PROMPTS[:2], max_new_tokens=NEW).stats.finish_reasons[1] == "stop"
    assert configured.generate(PROMPTS[:2], max_new_tokens=NEW, stop=[]).token_ids == full.token_ids


def test_stream_never_shows_the_stop_string(self_drafting):
    full = self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW)
    stop = stop_inside(self_drafting, full, 0, 8)
    pieces = list(self_drafting.stream(PROMPTS[0], max_new_tokens=NEW, stop=[stop]))
    assert "".join(pieces) == self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW, stop=[stop]).texts[0]
    assert all(stop not in p for p in pieces) and stop not in "".join(pieces)



@pytest.mark.parametrize("start, length", [(0, 6), (1, 9), (3, 12), (6, 14)])
def test_stream_holds_back_a_long_stop_that_starts_early(plain, self_drafting, start, length):
    """A stop longer than the text so far: all of that text is held back (it may be the stop's
    start), so the pieces still join to generate's text when the stop completes."""
    full = plain.generate(PROMPTS[:1], max_new_tokens=NEW)
    text = full.texts[0]
    assert len(text) >= start + length, f"the text is too short for the test: {text!r}"
    stop = text[start: start + length]
    for decoder in (plain, self_drafting):
        want = decoder.generate(PROMPTS[:1], max_new_tokens=NEW, stop=[stop])
        assert want.stats.finish_reasons == ["stop"] and want.texts[0] == text[: text.index(stop)]
        pieces = list(decoder.stream(PROMPTS[0], max_new_tokens=NEW, stop=[stop]))
        assert "".join(pieces) == want.texts[0]
        chunks = list(decoder.stream_chunks(PROMPTS[0], max_new_tokens=NEW, stop=[stop]))
        assert "".join(chunk.text for chunk in chunks) == want.texts[0]

def test_stop_check_keeps_the_shortest_prefix_spelling_a_stop():
    words = {1: "ab", 2: "c", 3: "d\n", 4: "\ne", 5: "f"}
    check = StopStrings(lambda ids: "".join(words[i] for i in ids), ["\n\n", "zz"])
    assert check([1, 2], [3, 4, 5]) == 2  # "abc" + "d\n" + "\ne": the stop completes at the 2nd new token
    assert check([1], [2, 5]) is None
    assert check([3], [4, 5]) == 1  # it straddles the round's boundary
    assert check.cut("x\n\ny\n\n") == "x" and check.cut("xy") == "xy"


@pytest.mark.parametrize("stop, message", [
    ("\n\n", r"stop must be a list of strings"),
    ([""], "stop strings must not be empty"),
    ([1], r"stop must be a list of strings"),
])
def test_bad_stop_values_are_named(plain, stop, message):
    with pytest.raises(ValueError, match=message):
        plain.generate(PROMPTS[:1], max_new_tokens=2, stop=stop)


def test_cli_stop_matches_the_python_api(tiny_models, tmp_path, capsys, self_drafting):
    full = self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW)
    stop = stop_inside(self_drafting, full, 0, 10)
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"target": {"path": str(tiny_models["llama"][0])},
                                  "drafter": self_drafting.config["drafter"]}))
    assert cli.main(["generate", "--config", str(config), "--prompt", PROMPTS[0], "--stop", stop,
                     "--max-new-tokens", str(NEW), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = self_drafting.generate(PROMPTS[:1], max_new_tokens=NEW, stop=[stop])
    assert got["token_ids"] == want.token_ids and got["texts"] == want.texts
    assert got["stats"]["finish_reasons"] == ["stop"]


def test_stop_without_a_tokenizer_is_refused(tiny_models, tmp_path):
    """Stop strings are text: a target folder without a tokenizer cannot have them."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_models["llama"][0].iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            (bare / f.name).write_bytes(f.read_bytes())
    decoder = draftsman.load({"target": {"path": str(bare)}})
    with pytest.raises(ValueError, match="stop strings need a tokenizer.*end rows with EOS or max_new_tokens"):
        decoder.generate(input_ids=[[5, 6]], max_new_tokens=2, stop=["x"])
    assert decoder.generate(input_ids=[[5, 6]], max_new_tokens=2).token_ids[0]  # and the decoder still works


def _full_decode_check(decode, strings, before, new):
    """The check as it was: decode the row's whole text each time."""
    def stops(tokens):
        return any(s in decode(tokens) for s in strings)
    if not stops(before + new):
        return None
    return next(keep for keep in range(1, len(new) + 1) if stops(before + new[:keep]))


def test_windowed_stop_check_agrees_with_decoding_the_whole_row(plain):
    """The check decodes only a window of the row's earlier tokens; on random token streams of the
    real tokenizer (special tokens that decode to nothing, bytes of split characters included)
    it keeps exactly what decoding the whole row keeps."""
    import random
    rng = random.Random(0)
    vocab = len(plain.tokenizer)
    agreed = stopped = 0
    for trial in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(20, 120))]
        cut = rng.randrange(1, len(tokens) - 4)
        before, new = tokens[:cut], tokens[cut: cut + rng.randrange(1, 6)]
        text = plain.decode(before + new)
        at = rng.randrange(max(1, len(text) - 6), len(text)) if text else 0
        strings = [text[at: at + rng.randrange(1, 5)] or "zz", "\n\n"]
        if any(s in plain.decode(before) for s in strings):
            continue  # an earlier round would have stopped the row
        expected = _full_decode_check(plain.decode, strings, before, new)
        assert StopStrings(plain.decode, strings)(before, new) == expected, (trial, before, new, strings)
        agreed += 1
        stopped += expected is not None
    assert agreed > 150 and stopped > 50  # most trials ran, and many stopped


def test_the_window_widens_over_tokens_that_decode_to_nothing():
    words = {0: "", 1: "a", 2: "b", 3: "\n"}  # 0: a special token, skipped when decoding
    decode = lambda ids: "".join(words[i] for i in ids)  # noqa: E731
    check = StopStrings(decode, ["\nab"])
    before = [3] + [0] * 100 + [1]
    assert check(before, [2]) == 1  # the stop starts 101 tokens back
    assert check([1] + [0] * 100 + [1], [2]) is None
