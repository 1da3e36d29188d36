"""Drafting under penalties: a model drafter penalises its own logits the way the engine
penalises the target's (verifier/sampling.py), each draft token for its own context (the
committed tokens and the draft tokens above it), so its guesses follow the penalised target:
Hugging Face's repetition penalty (every token the context holds) and vLLM's presence / frequency
penalties (how often each token was generated: the prompt does not count, draft tokens do).

The penalties act on raw logits, so this pays for logits on the target's scale. On the bundled
target at T=0 with repetition_penalty 1.2 (18 prompts), tau rose from 4.36 to 4.99 for EAGLE-3,
2.46 to 2.53 for MTP, 2.10 to 2.12 for Medusa (whose heads see the committed text only: its
candidates are ranked per head, not per node). The separately trained draft model's tree fell
from 2.53 to 2.38, so `draft_model` penalises its drafts only under `penalise_drafts`
(docs/choosing-a-drafter.md). Under frequency_penalty 0.5, EAGLE-3's tau went from 3.96 / 3.70 /
3.46 to 4.57 / 4.40 / 3.96 (continuation / copy / docstring prompts); the other heads and
presence_penalty alone moved less, both ways (the table in docs/choosing-a-drafter.md).

Drafts only. A sampled draft token's q is the distribution it was drawn from, penalised or not,
so the verifier stays exact either way (tests/test_engine_sampling.py).

One int32 tensor per position carries both: 2 x (times generated) + 1 when the context holds the
token at all. It is > 0 exactly where the repetition penalty applies, its half (rounded down) is
the presence / frequency count, and a draft token adds 2. The drafters index, expand and extend
it as one tensor, whichever penalties a request sets.
"""
from __future__ import annotations

import torch

from ..verifier.context_tokens import ContextTokens
from ..verifier.grammar import DraftGrammar
from ..verifier.sampling import RowSampling, penalize_counts, penalize_repeats, row_penalties
from .draft_bias import BAN, DraftBias, RowDraftBias
from .eos_ban import EosBan
from .path_bans import PathBanRound, PathBans


def draft_biases(sampling) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias, with a ban for each one-token bad word (the target's logit is
    -inf there, so such a draft could only be rejected). A bad word that is only an EOS token,
    which the engine ignores as Hugging Face does, is banned from drafts too: drafts only, so the
    output is unchanged. Longer bad words depend on the context and are left to the verifier."""
    if sampling is None:
        return ()
    biases = dict(sampling.logit_bias or ())
    biases.update({word[0]: BAN for word in sampling.bad_words_ids or () if len(word) == 1})
    return tuple(sorted(biases.items()))


class DraftContext:
    """A drafter's rows under penalties, kept across a request's rounds: which tokens each row's
    context holds and how often each was generated (verifier/context_tokens.py: updated with each
    round's tokens, not rebuilt)."""

    def __init__(self, prompts: list[list[int]], vocab_size: int, device):
        self.generated_from = [len(p) for p in prompts]  # the prompt's tokens are not counted
        self.device = device
        self.eos_columns: torch.Tensor | None = None  # EosBan.columns_of, found again when the end tokens change
        self.eos_columns_of: frozenset[int] = frozenset()  # ...the end tokens they were found for
        # The bias over the drafter's logits, per logits width, made again when the rows' settings change
        self._bias_for = None
        self._biases: dict[int, DraftBias | RowDraftBias | None] = {}
        self.held = ContextTokens(vocab_size, device)
        self.generated = ContextTokens(vocab_size, device, counts=True)
        self._path_bans = PathBans()
        self._columns: dict[int, int] | None = None  # a draft vocabulary's token id -> logit index

    def select_rows(self, indices: list[int]) -> None:
        self.generated_from = [self.generated_from[i] for i in indices]
        self.held.select_rows(indices)
        self.generated.select_rows(indices)
        self._path_bans.select_rows(indices)

    def add_rows(self, prompts: list[list[int]]) -> None:
        """Rows join after the others (the token tables rebuild once, seeing more rows)."""
        self.generated_from += [len(p) for p in prompts]

    def biased(self, sampling, logits: torch.Tensor, vocab_map: torch.Tensor | None,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """(..., width) logits fresh from the drafter's network plus the logit_bias
        (drafters/draft_bias.py) and the one-token bad words as bans; the same tensor without
        either. sampling: the request's, or the rows' own (draft_sampling(): a RowSampling biases
        row b of the logits, their first dim, by row b's; rows: which of the batch's rows that
        first dim holds, when not all). Call it before penalising: the engine adds the bias first."""
        if sampling is not self._bias_for:  # the engine keeps its settings objects while rows stay
            self._bias_for, self._biases = sampling, {}
        width = logits.shape[-1]
        if width not in self._biases:
            self._biases[width] = self._bias_of(sampling, width, vocab_map)
        bias = self._biases[width]
        return logits if bias is None else bias.apply(logits, rows)

    def _bias_of(self, sampling, width: int, vocab_map: torch.Tensor | None) -> DraftBias | RowDraftBias | None:
        if isinstance(sampling, RowSampling):
            row_biases = [draft_biases(params) for params in sampling.rows]
            if any(biases != row_biases[0] for biases in row_biases[1:]):
                return RowDraftBias(row_biases, width, vocab_map, self.device)
            sampling = sampling.rows[0]
        biases = draft_biases(sampling)
        return DraftBias(biases, width, vocab_map, self.device) if biases else None

    def path_bans(self, sampling, contexts: list[list[int]], vocab_map: torch.Tensor | None,
                  grammar: DraftGrammar | None = None) -> PathBanRound | None:
        """This round's bans that depend on the drafts above a token (no_repeat_ngram_size, bad
        words of several tokens, the rows' grammars: drafters/path_bans.py); None when no row has
        one. vocab_map: the draft vocabulary's row -> token id (fixed for a request), None for all
        tokens. grammar: the drafter's (Drafter.grammar)."""
        bans = self._path_bans.round(sampling, contexts, grammar)
        if bans is not None and vocab_map is not None:
            if self._columns is None:
                self._columns = {token: column for column, token in enumerate(vocab_map.tolist())}
            bans.columns, bans.vocab_map = self._columns, vocab_map
        return bans

    def eos_ban(self, drafter, contexts: list[list[int]], width: int,
                vocab_map: torch.Tensor | None) -> EosBan | None:
        """This round's EosBan under the request's min_new_tokens (set on the drafter by the
        engine); None when it bans nothing. A drafter's logits and draft vocabulary are fixed for
        a request (begin() picks them, then makes this context), so EOS's columns are found once,
        and again only when rows join with stop tokens of their own."""
        if not drafter.min_new_tokens or not drafter.eos_token_ids:
            return None
        if self.eos_columns is None or self.eos_columns_of != drafter.eos_token_ids:
            self.eos_columns = EosBan.columns_of(drafter.eos_token_ids, width, vocab_map, self.device)
            self.eos_columns_of = drafter.eos_token_ids
        produced = [len(c) - n for c, n in zip(contexts, self.generated_from)]
        return EosBan.for_round(produced, drafter.min_new_tokens_per_row(len(contexts)), self.eos_columns, self.device)

    def round(self, sampling, contexts: list[list[int]], width: int,
              vocab_map: torch.Tensor | None) -> "DraftRepeats | None":
        """This round's DraftRepeats over the drafter's `width` logits (all tokens, or a draft
        vocabulary's rows: `vocab_map` row -> token id); None without penalties (drafting is then
        unchanged). sampling: the request's, or each row's own (a RowSampling: each row's drafts
        penalised as the target will penalise that row)."""
        if sampling is None:
            return None
        repetition, presence, frequency = row_penalties(sampling, self.device)
        counts = presence is not None or frequency is not None
        if repetition is None and not counts:
            return None
        state = torch.zeros((), dtype=torch.int32)
        if counts:
            state = 2 * self.generated.update(contexts, first=self.generated_from)
        if repetition is not None:
            state = state + self.held.update(contexts)  # bool + int32 -> int32
        state = state[:, :width] if vocab_map is None else state[:, vocab_map]
        return DraftRepeats((repetition, presence, frequency), state)


class DraftRepeats:
    """One round's penalties: `root_state` (B, width), the committed context of each row's root;
    each penalty None, one number, or a (B,) tensor of one per row (row_penalties)."""

    def __init__(self, penalties: tuple, root_state: torch.Tensor):
        self.repetition, self.presence, self.frequency = penalties
        self.counts = self.presence is not None or self.frequency is not None
        self.root_state = root_state

    def penalise(self, logits: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """(B, ..., width) logits of positions whose contexts hold `state` (B, ..., width),
        penalised in the engine's order: repetition first, then presence / frequency."""
        logits = logits[..., : state.shape[-1]]
        if self.repetition is not None:
            logits = penalize_repeats(logits, state > 0, self.repetition)
        if self.counts:
            per_row = lambda value: (value.to(logits.dtype).view(-1, *[1] * (logits.dim() - 1))  # noqa: E731
                                     if isinstance(value, torch.Tensor) else value)
            logits = penalize_counts(logits, state // 2, per_row(self.presence), per_row(self.frequency))
        return logits

    def rows(self, index: torch.Tensor) -> "DraftRepeats":
        """The penalties of a subset of rows (drafters that draft for some rows only)."""
        pick = lambda value: value[index] if isinstance(value, torch.Tensor) else value  # noqa: E731
        return DraftRepeats((pick(self.repetition), pick(self.presence), pick(self.frequency)), self.root_state[index])

    @staticmethod
    def plus(state: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The states (..., width) after appending the drafted logit indices (...): one more
        generated token each."""
        return state.clone().scatter_add_(-1, index[..., None], torch.full_like(index[..., None], 2, dtype=state.dtype))
