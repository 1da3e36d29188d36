"""Streaming detokenization (draftsman/detokenize.py): decoding a window per round spells exactly
what decoding the whole output spells, for a byte-level BPE tokenizer and a SentencePiece-style one
(leading space dropped per decode, byte-fallback tokens), and a stream decodes a bounded window."""
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import draftsman
from draftsman.detokenize import INCOMPLETE, IncrementalText

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "zoo" / "python-target"


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's decoder over a small vocabulary: "▁" for spaces, <0xNN> byte tokens for what the
    vocabulary lacks, a leading space stripped from every decode, <s> / </s> special."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁def", "▁x", "▁=", "▁the", "a", "b", "(", ")", ":", "é", "€", "▁ü", "ab", "▁(", "::"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream_text(decode, tokens: list[int], rng: random.Random) -> tuple[str, int]:
    """Feed `tokens` in rounds of 1-8; the joined pieces and the most tokens one decode read."""
    calls = []
    text = IncrementalText(lambda ids: calls.append(len(ids)) or decode(ids))
    pieces, i = [], 0
    while i < len(tokens):
        n = rng.randrange(1, 9)
        pieces.append(text.add(tokens[i: i + n]))
        i += n
    assert "".join(pieces) == text.text
    return text.text, max(calls)


@pytest.fixture(scope="module", params=["bundled byte-level BPE", "sentencepiece-style"])
def tokenizer(request):
    if request.param == "sentencepiece-style":
        return sentencepiece_style_tokenizer()
    return AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)


def test_pieces_spell_the_whole_decode_on_random_token_streams():
    """Random ids of the bundled tokenizer: special tokens that decode to nothing, bytes of split
    or invalid characters (its byte-level decoder replaces each invalid sequence where it is)."""
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    held_at_end = 0
    for trial in range(300):
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 200))]
        whole = decode(tokens)
        text, _ = stream_text(decode, tokens, rng)
        if whole.endswith(INCOMPLETE):  # the stream holds back a character that never completed
            assert whole.startswith(text), trial
            held_at_end += 1
        else:
            assert text == whole, (trial, tokens)
    assert held_at_end < 150  # most trials compared whole texts


def test_pieces_spell_the_whole_decode_on_random_text(tokenizer):
    """Random text (characters outside the vocabulary become byte tokens) with special tokens
    between its tokens. Only valid UTF-8: SentencePiece's byte fallback turns a whole run of byte
    tokens into one replacement per byte when any of it is invalid, which no decoder that shows
    text as it arrives could match (a model would have to emit broken UTF-8)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    alphabet = list("ab ()=:x\n\té€üжß") + ["def ", " the ", "😀", "::"]
    specials = tokenizer.all_special_ids
    for trial in range(200):
        source = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
        tokens = []
        for token in tokenizer(source, add_special_tokens=False)["input_ids"]:
            tokens += [token] + ([rng.choice(specials)] if rng.random() < 0.1 else [])
        text, _ = stream_text(decode, tokens, rng)
        assert text == decode(tokens), (trial, source)


def test_pieces_spell_real_text_and_each_decode_reads_a_window(tokenizer):
    source = ("def parse(text):\n    ab = (x == 'é€ü')  # the € sign\n    return ab::x\n" * 40)
    tokens = tokenizer(source, add_special_tokens=False)["input_ids"]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    text, widest = stream_text(decode, tokens, random.Random(1))
    assert text == decode(tokens)
    assert len(tokens) > 500 and widest <= 40  # two rounds and a few held bytes, never the whole row


def test_a_tokenizer_that_rewrites_shown_text_stalls_rather_than_inventing_text():
    """A decode that is not separable (here one that drops a space before '.') makes the window
    wait; nothing it yields contradicts what it already yielded."""
    words = {1: "a", 2: " ", 3: ".", 4: "b"}
    decode = lambda ids: "".join(words[i] for i in ids).replace(" .", ".")  # noqa: E731
    text = IncrementalText(decode)
    assert text.add([1, 2]) == "a "
    assert text.add([3]) == ""  # "a " was shown; the window now reads "a.": not an extension
    assert text.add([4]) == "" and text.text == "a "


def test_stream_decodes_a_window_per_round(tiny_models):
    """Decoder.stream: no decode but the final one reads the whole output."""
    dec = draftsman.load({"target": {"path": str(tiny_models["llama"][0])},
                          "drafter": {"name": "draft_model", "path": str(tiny_models["llama"][0]), "k": 4}})
    dec.engine.eos_token_ids = set()  # 200 tokens, not a random model's early EOS
    widths = []
    decode = dec.decode
    dec.decode = lambda ids: widths.append(len(ids)) or decode(ids)
    pieces = list(dec.stream("def parse(", max_new_tokens=200))
    assert widths[-1] == 200 and max(widths[:-1]) <= 40  # the final decode, as generate's; windows before
    assert "".join(pieces) == dec.generate(["def parse("], max_new_tokens=200).texts[0]
