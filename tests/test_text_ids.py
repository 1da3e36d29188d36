"""`cross_tokenizer` keeps each row's text in the draft model's ids a round at a time
(drafters/text_ids.py): after every round a row holds exactly the ids that encoding its whole
text gives, for draft tokenizers of the kinds draft models use (byte-level BPE with and without
trimmed offsets, SentencePiece-style with a prepended space, Llama-2's legacy normalizer), and
nearly every round encodes only the end of the text. The draft cache keeps the ids it shares."""
import inspect
import json
import random
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from draftsman.detokenize import INCOMPLETE
from draftsman.drafters.cross_tokenizer import _common_prefix
from draftsman.drafters.text_ids import TextIds
from tiny_models import CORPUS, EOT

ZOO_TOKENIZER = Path(__file__).resolve().parents[1] / "zoo" / "python-target"
# Code, prose with accents and symbols (split into bytes by the small byte-level vocabularies).
TEXTS = [inspect.getsource(textwrap)[:6000],
         "Les élèves ont noté: « déjà vu » → 5 € ≈ 5.4 $ 🙂.  Ünïcode   spaces\n\n\ttabs and  double  spaces. "
         * 8]


def trained(tok: Tokenizer, vocab_size: int, specials: list[str]) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(CORPUS + TEXTS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                initial_alphabet=alphabet, show_progress=False))
    return tok


def byte_level(trim_offsets: bool) -> PreTrainedTokenizerFast:
    """GPT-2 / Llama-3 / Qwen style; with trimmed offsets a token's span leaves out its leading space."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if trim_offsets:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    return PreTrainedTokenizerFast(tokenizer_object=trained(tok, 600, [EOT]), eos_token=EOT, bos_token=EOT)


def with_bos(tok: Tokenizer) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])


def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece style: spaces as "▁", one prepended to every encoding, BOS added."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = trained(tok, 500, ["<unk>", "<s>", "</s>"])
    tok.post_processor = with_bos(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama2_legacy() -> PreTrainedTokenizerFast:
    """Llama-2's tokenizer.json: a normalizer that prepends "▁" to every encoding and replaces
    spaces, no pre-tokenizer, a decoder that strips the leading space. Its vocabulary is trained
    word by word, as SentencePiece trains Llama-2's."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok = trained(tok, 500, ["<unk>", "<s>", "</s>"])
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = with_bos(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def draft_tokenizers():
    kinds = {"byte-level": lambda: byte_level(False), "byte-level-trimmed": lambda: byte_level(True),
             "metaspace": metaspace, "llama2-legacy": llama2_legacy}
    if (ZOO_TOKENIZER / "tokenizer.json").is_file():
        kinds["bundled"] = lambda: AutoTokenizer.from_pretrained(ZOO_TOKENIZER)
    return kinds


DRAFT_TOKENIZERS = draft_tokenizers()


def grow(text_ids: TextIds, target_tokenizer, draft_tokenizer, tokens: list[int], rng: random.Random) -> int:
    """Feed one row its tokens in rounds of 1-6 and check it after each; the rounds whose text grew."""
    grew, n, held = 0, 0, ""
    while n < len(tokens):
        n = min(len(tokens), n + rng.randrange(1, 7))
        ids = text_ids.ids(0, tokens[:n])
        text = text_ids.rows[0].text.text
        whole = target_tokenizer.decode(tokens[:n], skip_special_tokens=True)
        # The row's text is the decode of its tokens, short of a character whose bytes have not all come.
        assert whole == text or (whole.endswith(INCOMPLETE) and whole.startswith(text)), (text[-20:], whole[-20:])
        assert ids == draft_tokenizer(text, verbose=False)["input_ids"], (n, text[-40:])
        grew += text != held
        held = text
    return grew


@pytest.mark.parametrize("kind", list(DRAFT_TOKENIZERS))
def test_each_round_holds_the_ids_of_the_whole_text(kind, tiny_tokenizer):
    draft_tokenizer = DRAFT_TOKENIZERS[kind]()
    text_ids = TextIds(tiny_tokenizer, draft_tokenizer)
    rng = random.Random(0)
    for text in TEXTS:
        text_ids.reset(1)
        grew = grow(text_ids, tiny_tokenizer, draft_tokenizer, tiny_tokenizer(text)["input_ids"], rng)
        # The first round encodes the whole prompt; later ones nearly always only the end.
        assert text_ids.whole + text_ids.extended == grew
        assert text_ids.extended >= 0.9 * grew, (text_ids.whole, text_ids.extended)


def test_rows_follow_the_batch(tiny_tokenizer):
    """keep_rows / add_rows move each row's ids with it; a row whose tokens are not an extension of
    what it held (another request in its place) starts again from its whole text."""
    draft_tokenizer = DRAFT_TOKENIZERS["byte-level"]()
    text_ids = TextIds(tiny_tokenizer, draft_tokenizer)
    rows = [tiny_tokenizer(t)["input_ids"] for t in (CORPUS[0], CORPUS[1], CORPUS[2] * 3)]
    expect = lambda tokens: draft_tokenizer(tiny_tokenizer.decode(tokens), verbose=False)["input_ids"]  # noqa: E731
    text_ids.reset(2)
    assert [text_ids.ids(b, rows[b][:10]) for b in (0, 1)] == [expect(rows[0][:10]), expect(rows[1][:10])]
    text_ids.keep_rows([1])
    text_ids.add_rows(1)
    assert text_ids.ids(0, rows[1][:14]) == expect(rows[1][:14])
    assert text_ids.ids(1, rows[2][:30]) == expect(rows[2][:30])
    whole = text_ids.whole
    assert text_ids.ids(1, rows[0][:12]) == expect(rows[0][:12])  # not an extension of row 1's tokens
    assert text_ids.whole == whole + 1


def test_tokenizers_that_cannot_extend_encode_the_whole_text(tiny_tokenizer):
    """A Python tokenizer has no offsets (ByT5's), and a tokenizer that ends every encoding with a
    special token has no end to extend: every round encodes the whole text, as before."""
    from transformers import ByT5Tokenizer

    closing = DRAFT_TOKENIZERS["metaspace"]()
    spec = closing.backend_tokenizer
    spec.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                        special_tokens=[("</s>", spec.token_to_id("</s>"))])
    for draft_tokenizer in (ByT5Tokenizer(), closing):
        text_ids = TextIds(tiny_tokenizer, draft_tokenizer)
        text_ids.reset(1)
        grew = grow(text_ids, tiny_tokenizer, draft_tokenizer, tiny_tokenizer(TEXTS[1][:400])["input_ids"],
                    random.Random(1))
        assert text_ids.whole == grew and text_ids.extended == 0, type(draft_tokenizer)


def test_the_cache_keeps_exactly_the_shared_start():
    """`cross_tokenizer` rolls the draft cache back to the ids the row still shares with it, found
    a chunk at a time: the same count as comparing id by id, wherever the two first differ."""
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(300))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(300))]
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == _common_prefix(b, a) == shared
