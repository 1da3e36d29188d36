"""Drafting under the bans that depend on the tokens before a position: no_repeat_ngram_size (a
token that would repeat an n-gram of the row) and bad words of several tokens (a word's last
token where the rest of it ends the sequence). The engine sets such a token's logit to -inf at
every tree node (verifier/ngram_ban.py), so a draft that proposes it can only be rejected. Each
draft position's sequence is the row's committed tokens and the drafts above it, so a drafter
asks per draft: model drafters mask the banned tokens in that draft's logits, and the copying
drafters (`ngram`, `retrieval`) end a continuation before the first one.

A copying drafter needs this most: under no_repeat_ngram_size a continuation copied after a match
of n-1 tokens or more repeats an n-gram at its first token, so it proposed only rejected tokens.

Structured output is the same kind of rule: a row's grammar allows a token after the row's output
and the drafts above it (verifier/grammar.py), and the engine hands each round's grammars to the
drafter (Drafter.grammar). Model drafters draft only what the grammar allows, and a copied
continuation ends before the first token it does not (the copying drafters also draft what the
grammar forces next: DraftGrammar.forced).

Drafts only. A sampled draft token's q is the distribution it was drawn from, masked or not, so
the verifier stays exact either way; a deterministic draft needs no q. One-token bad words and
logit_bias bans hold everywhere: model drafters take them in their bias (drafters/draft_bias.py);
the copying drafters, which have no logits to bias, ask for them here too (`everywhere`).
"""
from __future__ import annotations

import torch

from ..verifier.grammar import DraftGrammar
from ..verifier.ngram_ban import BadWords, CommittedNgrams
from ..verifier.sampling import RowSampling
from .draft_bias import banned_ids


class PathBans:
    """A request's rows' bans, kept across rounds (each row's committed n-grams are indexed as it
    grows, not again per round); rows leave and join with the drafter's. everywhere: the tokens a
    row bans at every position (a -100 logit_bias, one-token bad words) are banned too, for the
    drafters that copy tokens (model drafters have them in their bias)."""

    def __init__(self, everywhere: bool = False):
        self.everywhere = everywhere
        self._ngrams: list[CommittedNgrams | None] = []  # per row, once its setting bans repeats
        self._words: dict[tuple, BadWords] = {}  # per bad_words_ids setting

    def select_rows(self, indices: list[int]) -> None:
        self._ngrams = [self._ngrams[i] if i < len(self._ngrams) else None for i in indices]

    def round(self, sampling, contexts: list[list[int]], grammar: DraftGrammar | None = None) -> "PathBanRound | None":
        """This round's bans per row, under `sampling` (the request's, or the rows' own:
        draft_sampling()), with the rows' grammars (the drafter's `grammar`: None when no row has
        one); None when no row bans anything asked for and there is no grammar."""
        settings = sampling.rows if isinstance(sampling, RowSampling) else [sampling] * len(contexts)
        if not any(self._bans(params) for params in settings) and grammar is None:
            return None
        self._ngrams += [None] * (len(contexts) - len(self._ngrams))  # rows that joined
        rows = []
        for b, (params, context) in enumerate(zip(settings, contexts)):
            n = params.no_repeat_ngram_size if params.bans_repeated_ngrams else 0
            ngrams = None
            if n:
                if self._ngrams[b] is None or self._ngrams[b].n != n:
                    self._ngrams[b] = CommittedNgrams(n)
                ngrams = self._ngrams[b].update(context)
            words = None
            if params.bans_words:
                if params.bad_words_ids not in self._words:
                    # EOS words kept: the engine ignores them, as Hugging Face does; drafts only
                    self._words[params.bad_words_ids] = BadWords(params.bad_words_ids)
                words = self._words[params.bad_words_ids]
            always = frozenset()
            if self.everywhere:
                always = banned_ids(params) | frozenset(words.singles if words is not None else ())
            rows.append(_RowBan(ngrams, words, always, context))
        return PathBanRound(rows, grammar)

    def _bans(self, params) -> bool:
        return params is not None and (params.bans_repeated_ngrams or params.bans_words or
                                       self.everywhere and bool(banned_ids(params)))


class _RowBan:
    """One row's bans this round: its n-grams (or None), bad words (or None) and the tokens banned
    at every position (`always`), with the end of its committed tokens that a draft's sequence
    starts from."""

    def __init__(self, ngrams: CommittedNgrams | None, words: BadWords | None, always: frozenset[int],
                 context: list[int]):
        self.ngrams, self.words, self.always = ngrams, words, always
        self.ngram_head = ngrams.head(context) if ngrams is not None else []
        self.word_head = context[max(0, len(context) - words.reach):] if words is not None else []

    def banned(self, path: list[int]) -> set[int]:
        banned = self.ngrams.banned(self.ngram_head, path) if self.ngrams is not None else set()
        if self.words is not None:
            banned |= self.words.completing(self.word_head + path)
        return banned | self.always


class PathBanRound:
    """One round's bans: what each row may not draft after a path of drafts."""

    def __init__(self, rows: list[_RowBan], grammar: "DraftGrammar | None" = None):
        self.rows = rows
        self.grammar = grammar  # what each row's structured_output allows (verifier/grammar.py), or None
        # Under a draft vocabulary: token id -> logit index, and logit index -> token id (a tensor)
        self.columns: dict[int, int] | None = None
        self.vocab_map: torch.Tensor | None = None

    def banned(self, row: int, path: list[int]) -> set[int]:
        """The tokens row `row` may not draft after `path` (its drafts below the root, in order)."""
        return self.rows[row].banned(path)

    def cut(self, row: int, continuation: list[int]) -> list[int]:
        """A copied continuation up to its first banned token, or the first its grammar does not allow."""
        for j, token in enumerate(continuation):
            if token in self.rows[row].banned(continuation[:j]):
                continuation = continuation[:j]
                break
        return continuation if self.grammar is None else continuation[:self.grammar.fits(row, continuation)]

    def mask(self, logits: torch.Tensor, paths: list, rows: list[int] | None = None) -> torch.Tensor:
        """(B, width) or (B, K, width) logits of drafts, with -inf where banned or where the row's
        grammar does not allow the token: paths[b] (or paths[b][k]) is the path the draft follows;
        rows: the row of each b, when not b. Token ids become logit indices through `columns` (None:
        they are equal; ids at or past width are left out). A new tensor: the caller's logits may
        be cached. A draft position that would have nothing left keeps its logits (the target's
        own are then all -inf too, or the draft vocabulary lacks what the grammar allows)."""
        width, columns = logits.shape[-1], self.columns
        drafts = [(b, k, b if rows is None else rows[b], path) for b, row_paths in enumerate(paths)
                  for k, path in enumerate(row_paths if logits.dim() == 3 else [row_paths])]
        at: list[list[int]] = [[] for _ in range(logits.dim())]
        for b, k, row, path in drafts:
            for token in self.banned(row, path):
                column = token if columns is None else columns.get(token, width)
                if column < width:
                    at[0].append(b)
                    if logits.dim() == 3:
                        at[1].append(k)
                    at[-1].append(column)
        out = logits
        if at[0]:
            out = logits.clone()
            out[tuple(torch.tensor(i, device=logits.device) for i in at)] = -torch.inf
        if self.grammar is not None:
            out = self._held_to_grammar(out, out is logits, drafts)
        if out is logits:
            return logits
        emptied = torch.isneginf(out).all(-1) & ~torch.isneginf(logits).all(-1)
        return torch.where(emptied[..., None], logits, out)

    def _held_to_grammar(self, logits: torch.Tensor, shared: bool, drafts: list) -> torch.Tensor:
        """The logits with -inf where each draft's row grammar does not allow the token (a copy
        when `shared`: the caller's own)."""
        keys, masks = self.grammar.masks([((b, k), row, path) for b, k, row, path in drafts])
        if not keys:
            return logits
        if shared:
            logits = logits.clone()
        logits = logits.contiguous()
        # vocab_map: each draft column's token id (its ids are the target's, all within the masks)
        if logits.dim() == 3:
            at = [b * logits.shape[1] + k for b, k in keys]
        else:
            at = [b for b, _ in keys]
        masks.apply_(logits.view(-1, logits.shape[-1]), at, self.vocab_map)
        return logits
