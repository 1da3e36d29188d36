"""A token datastore for the `retrieval` drafter: documents tokenized once with the target's
tokenizer, and for each n-gram size a sorted table of window hashes, so that every place an
n-gram occurs is one binary search away (REST keeps a suffix array for the same question).

Hashes are polynomial modulo a prime below 2^31 (no int64 overflow), so two n-grams may share
one; every hit is checked against the tokens, so a collision costs a comparison, never a wrong
draft.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

BOUNDARY = -1  # between documents: no query contains it, and continuations stop before it
_MULTIPLIER = 1_000_003
_MODULUS = 2_147_483_647  # 2^31 - 1: h * _MULTIPLIER + token stays far inside int64


def window_hashes(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Hash of every window of n tokens (len(tokens) - n + 1 of them)."""
    count = tokens.numel() - n + 1
    if count <= 0:  # a text shorter than n: no window (the slices below would wrap round)
        return torch.zeros(0, dtype=torch.long)
    h = torch.zeros(count, dtype=torch.long)
    for j in range(n):
        h = (h * _MULTIPLIER + tokens[j: j + count]) % _MODULUS  # BOUNDARY (-1) hashes too: % is non-negative
    return h


class Datastore:
    def __init__(self, tokens: torch.Tensor, sizes: range,
                 tables: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        """tables: the (sorted hashes, their positions) of each size, as built before and saved
        (drafters/datastore_index.py); built here when not given."""
        self.tokens = tokens
        self.sizes = sizes
        self.tables = dict(tables or {})
        for n in sizes:
            if n in self.tables:
                continue
            h = window_hashes(tokens, n)[: max(tokens.numel() - n, 0)]  # a window needs a token after it
            order = torch.argsort(h, stable=True)  # equal hashes keep datastore order
            self.tables[n] = (h[order], order)

    @classmethod
    def from_texts(cls, texts: list[str], tokenizer, sizes: range) -> "Datastore":
        parts = []
        for start in range(0, len(texts), 256):  # batches: fast tokenizers run them in parallel
            rows = tokenizer(texts[start:start + 256], add_special_tokens=False, verbose=False)["input_ids"]
            parts += [torch.tensor(row + [BOUNDARY], dtype=torch.long) for row in rows]
        return cls(torch.cat(parts), sizes)

    def continuations(self, context: list[int], k: int, branches: int, max_matches: int) -> list[list[int]]:
        """Up to `branches` continuations of at most k tokens that followed the context's last n
        tokens in the datastore, longest n with a match first, most frequent first (ties: the
        earlier in the datastore), each cut at a document boundary."""
        for n in reversed(self.sizes):
            if n > len(context):
                continue
            query = torch.tensor(context[-n:], dtype=torch.long)
            keys, positions = self.tables[n]
            key = window_hashes(query, n)
            lo = int(torch.searchsorted(keys, key, right=False))
            hi = int(torch.searchsorted(keys, key, right=True))
            if lo == hi:
                continue
            at = positions[lo: min(hi, lo + max_matches)]
            windows = self.tokens[at[:, None] + torch.arange(n)]
            at = at[(windows == query).all(1)]  # drop hash collisions
            if at.numel() == 0:
                continue
            # Every match's next k tokens in one gather; past the datastore's end reads as a boundary.
            spots = (at + n)[:, None] + torch.arange(k)
            following = self.tokens[spots.clamp(max=self.tokens.numel() - 1)]
            following[spots >= self.tokens.numel()] = BOUNDARY
            counts = Counter()
            for cont in following.tolist():
                if BOUNDARY in cont:
                    cont = cont[: cont.index(BOUNDARY)]
                if cont:
                    counts[tuple(cont)] += 1
            if counts:
                return [list(c) for c, _ in counts.most_common(branches)]  # ties keep first-seen order
        return []

    def __len__(self) -> int:
        return int((self.tokens != BOUNDARY).sum())


def read_documents(path: str | Path) -> list[str]:
    """A text file (one document), a JSONL file ({"text": ...} per line) or a folder of such files
    (every file below it but hidden ones; files that are not UTF-8 text are skipped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"retrieval: datastore path '{path}' does not exist: give a text file, a JSONL file "
                                'of {"text": ...} lines, or a folder of such files')
    if path.is_dir():  # hidden files and folders (.git, .venv, ...) are not the text you meant
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        files = [path]
    texts, not_utf8 = [], []
    for f in files:
        try:
            content = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            if not path.is_dir():  # the one file given: skipping it would leave "no text", a wrong reason
                raise ValueError(f"retrieval: datastore file '{f}' is not UTF-8 text ({e.reason} at byte {e.start}): "
                                 "save it as UTF-8") from None
            not_utf8.append(f)
            continue
        except OSError:
            continue
        if f.suffix.lower() != ".jsonl":  # (UP.JSONL too)
            texts.append(content)
            continue
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, AttributeError):
                text = None
            if not isinstance(text, str):
                raise ValueError(f'retrieval: {f}:{n}: each JSONL line of a datastore needs a "text" string')
            texts.append(text)
    texts = [t for t in texts if t.strip()]
    if not texts:
        skipped = f" ({len(not_utf8)} file(s) skipped as not UTF-8 text, e.g. '{not_utf8[0]}': save them as UTF-8)" \
            if not_utf8 else ""
        raise ValueError(f"retrieval: datastore path '{path}' holds no text to look drafts up in{skipped}")
    return texts
