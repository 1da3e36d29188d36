"""Byte-level BPE for the demo models, trained with `tokenizers` on the train split.

Byte-level with no normaliser, no prefix space and no clean-up, so decode(encode(src)) == src
for any source file: the verifier compares token ids, and benchmarks decode text back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import EOT


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer, model_max_length: int = 1024):
    """The HF wrapper saved next to each model, loadable offline with AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int = 1024):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = wrap(tok, model_max_length)
    hf.save_pretrained(out_dir)
    return hf


def load_tokenizer(path: Path) -> Tokenizer:
    """Raw `tokenizers` object (fast batch encoding for building the token stream)."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
