"""Logits -> sampling distribution, exactly as the baseline sampler does it, and seeded draws.

Order and tie rules follow Hugging Face's logits warpers (temperature, then top-h, top-k, top-p,
min-p, typical-p, epsilon and eta cutoffs), so `drafter: none` through our engine samples the same
distribution as `model.generate(do_sample=True)`. Each warper only reshapes the target's
distribution; the verifier then samples that distribution exactly, whatever the drafter drew from.
(`typical_p` is Hugging Face's locally typical *sampling*, exact; Medusa's typical *acceptance*
below is a lossy acceptance rule and has nothing to do with it but the paper it cites.)
Temperature 0 means greedy: the distribution is one-hot on the first argmax.

A logit bias (OpenAI's `logit_bias`, Hugging Face's single-token `sequence_bias`) is added first,
to the target's logits at every position, as Hugging Face's generate adds sequence_bias before
its penalties and warpers; it depends on no context, so the engine adds it to the whole block. The repetition penalty comes
next, as Hugging Face's RepetitionPenaltyLogitsProcessor runs before the warpers. It depends on
each position's context, which only the engine knows (a tree node's context is the committed text
plus its own ancestors), so the engine applies it to the target's
logits (verifier/block_penalties.py, with `penalize_repeats`' arithmetic) before they reach
`processed_probs`. Drafters may ignore it: their q is whatever they drew from, and the verifier
stays exact either way. The presence and frequency
penalties of vLLM and the OpenAI API follow it (`penalize_counts`): they count generated tokens
only, so a node counts its ancestors but not the root, which is the prompt's last token or an
already counted one. Hugging Face's no_repeat_ngram_size is context-dependent too: the engine
bans, at each node, the tokens that would repeat an n-gram of its own sequence
(verifier/ngram_ban.py). So does a grammar (structured_output): the engine masks, at each node,
what the grammar does not allow after its own sequence (verifier/grammar.py).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .structured import StructuredOutput


@dataclass(frozen=True)
class TypicalAcceptance:
    posterior_threshold: float = 0.09  # Medusa's epsilon: a probability always enough to pass
    posterior_alpha: float = 0.3  # Medusa's delta: scales exp(-entropy), the bar where p is flat

    def __post_init__(self):
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"lossy_typical_acceptance.{name} must be a number > 0, got {value!r}")
        if self.posterior_threshold > 1:
            raise ValueError(f"lossy_typical_acceptance.posterior_threshold must be <= 1 (a probability), "
                             f"got {self.posterior_threshold!r}")

    @staticmethod
    def parse(value) -> "TypicalAcceptance | None":
        """The config value: null/false (off, exact), true (Medusa's defaults) or a mapping of
        posterior_threshold / posterior_alpha."""
        if value is None or value is False:
            return None
        if value is True:
            return TypicalAcceptance()
        if isinstance(value, TypicalAcceptance):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"posterior_threshold", "posterior_alpha"})
            if unknown:
                raise ValueError(f"lossy_typical_acceptance has unknown key(s) {unknown}; valid: "
                                 "['posterior_alpha', 'posterior_threshold']")
            return TypicalAcceptance(**value)
        raise ValueError(f"lossy_typical_acceptance must be null (exact), true (Medusa's defaults) or "
                         f"{{posterior_threshold: 0.09, posterior_alpha: 0.3}}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None  # 0 and -1 (vLLM's "all tokens") are None
    top_p: float | None = None
    min_p: float | None = None  # drop tokens below min_p x the most likely token's probability
    repetition_penalty: float | None = None  # HF's: logits of tokens already in the context / it (x it if < 0)
    presence_penalty: float | None = None  # vLLM / OpenAI: minus this for each token generated at least once
    frequency_penalty: float | None = None  # vLLM / OpenAI: minus this x how often a token was generated
    # OpenAI's: {token id: bias in [-100, 100]} added to the logits; kept as sorted (id, bias) pairs
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # LOSSY, off by default: Medusa's typical acceptance at temperature > 0 (verifier/typical.py);
    # None, True (Medusa's defaults) or {posterior_threshold, posterior_alpha}, kept as a TypicalAcceptance
    lossy_typical_acceptance: "TypicalAcceptance | bool | dict | None" = None
    # Hugging Face's truncation warpers, after min-p (null, 1 or 0 = off):
    typical_p: float | None = None  # keep the tokens nearest the entropy in surprise, mass typical_p
    epsilon_cutoff: float | None = None  # drop tokens of probability below it
    eta_cutoff: float | None = None  # drop tokens below min(eta, sqrt(eta) exp(-entropy))
    # Hugging Face's: a token that would repeat an n-gram of the sequence gets probability 0
    # (verifier/ngram_ban.py), at any temperature; null or 0 = off
    no_repeat_ngram_size: int | None = None
    # Hugging Face's: token sequences never generated ([[5], [7, 8]]: 5 nowhere, 8 never after 7);
    # kept as a tuple of tuples
    bad_words_ids: "list[list[int]] | tuple[tuple[int, ...], ...] | None" = None
    # Hugging Face's top-H (transformers 5): among the 100 likeliest tokens, keep the likeliest
    # while their cumulative entropy stays within top_h x the entropy of those 100; null = off
    top_h: float | None = None
    # vLLM's structured_outputs: the output held to a grammar (verifier/structured.py), e.g.
    # {"json": schema}, {"regex": "..."}, {"choice": [...]}; kept as a StructuredOutput
    structured_output: "StructuredOutput | dict | None" = None

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "structured_output", StructuredOutput.parse(self.structured_output))
        object.__setattr__(self, "lossy_typical_acceptance", TypicalAcceptance.parse(self.lossy_typical_acceptance))
        object.__setattr__(self, "bad_words_ids", _bad_words(self.bad_words_ids))
        _check_finite_numbers(self)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool):
            # an int (a numpy one too: one batch key with the int's); 0 and -1, vLLM's (and HF's 0)
            # "every token", are no top-k
            object.__setattr__(self, "top_k", None if int(self.top_k) in (0, -1) else int(self.top_k))
        if self.top_k is not None and (type(self.top_k) is not int or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer, or 0, -1 or null (no top-k), got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p!r}")
        if self.min_p is not None and not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] or null, got {self.min_p!r}")
        if self.top_h is not None and not (0.0 < self.top_h <= 1.0):
            raise ValueError(f"top_h must be in (0, 1] or null (off), got {self.top_h!r}")
        if self.typical_p is not None and not (0.0 < self.typical_p <= 1.0):
            raise ValueError(f"typical_p must be in (0, 1] (1 = off) or null, got {self.typical_p!r}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (0 = off; Hugging Face suggests 3e-4 to 9e-4 for "
                                 f"epsilon, 3e-4 to 2e-3 for eta) or null, got {value!r}")
        n = self.no_repeat_ngram_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"no_repeat_ngram_size must be a whole number >= 0 (0 = off), e.g. 3, or null, got {n!r}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = none) or null, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = none, as in vLLM and the OpenAI API) or null, "
                                 f"got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def lossy(self) -> bool:
        """Typical acceptance decides at temperature > 0: the output is not the target's distribution."""
        return self.lossy_typical_acceptance is not None and not self.greedy

    @property
    def penalizes_repeats(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def changes_logits(self) -> bool:
        """A bias, a penalty or a ban changes the target's logits before the warpers (and so what
        greedy decoding emits; the warpers never do)."""
        return (bool(self.logit_bias) or self.penalizes_repeats or self.penalizes_counts
                or self.bans_repeated_ngrams or self.bans_words or self.structured_output is not None)

    @property
    def bans_words(self) -> bool:
        return self.bad_words_ids is not None

    @property
    def bans_repeated_ngrams(self) -> bool:
        return bool(self.no_repeat_ngram_size)

    @property
    def penalizes_counts(self) -> bool:
        return bool(self.presence_penalty) or bool(self.frequency_penalty)

    def bias_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit bias as (token ids, biases) on `device`."""
        ids, biases = zip(*self.logit_bias)
        return torch.tensor(ids, device=device), torch.tensor(biases, device=device)


# The float settings. Their range checks alone let NaN and infinity through for temperature (NaN
# failed deep in sampling with an IndexError; an infinite one divides a banned token's -inf logit
# into NaN) and infinity for the repetition penalty; a string failed as a TypeError, a bool passed as 1.
_FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
                   "repetition_penalty", "presence_penalty", "frequency_penalty")


def _check_finite_numbers(params: "SamplingParams") -> None:
    for name in _FLOAT_SETTINGS:
        value = getattr(params, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def _bad_words(words) -> tuple[tuple[int, ...], ...] | None:
    """[[id, ...], ...] -> a tuple of tuples, None when empty."""
    if words is None:
        return None
    ok = isinstance(words, (list, tuple)) and all(
        isinstance(w, (list, tuple)) and w and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in w)
        for w in words)
    if not ok:
        raise ValueError(f"bad_words_ids must be a list of token-id lists, e.g. [[50256], [1, 2]] (each word one "
                         f"or more ids >= 0), got {words!r}")
    return tuple(tuple(w) for w in words) or None


def _bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """{id: bias} (ids may be strings of digits, as JSON writes keys) or (id, bias) pairs -> sorted
    pairs, None when empty."""
    if bias is None:
        return None

    def token_id(t) -> int:
        if isinstance(t, str) and t.strip().isdigit():
            return int(t)
        if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
            return t
        raise ValueError(t)

    try:
        pairs = sorted((token_id(t), float(b)) for t, b in (bias.items() if isinstance(bias, dict) else bias))
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or len({t for t, _ in pairs}) < len(pairs):
        raise ValueError(f"logit_bias must map token ids (integers >= 0) to biases, e.g. {{50256: -100}}, got {bias!r}")
    bad = [b for _, b in pairs if not -100.0 <= b <= 100.0]
    if bad:
        raise ValueError(f"logit_bias values must be in [-100, 100] (as in the OpenAI API; -100 all but bans a "
                         f"token), got {bad[:5]}")
    return tuple(pairs) or None


# The settings that only reshape the target's distribution at each position (the warpers and the
# temperature): rows of one batch may differ in these.
WARPER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
# The penalties change the logits, but each row's from its own context only, so rows may differ
# in these too (verifier/block_penalties.py takes a value per row).
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
# A logit bias depends on no context: each row's is added to its own logits (RowBiases). A ban
# depends on a position's own sequence only: each row's bans its own tokens (verifier/ngram_ban.py's
# BlockBans). Typical acceptance is one for the whole batch.
BIAS_FIELDS = ("logit_bias",)
BAN_FIELDS = ("no_repeat_ngram_size", "bad_words_ids")
# A grammar too depends on a position's own sequence only (verifier/grammar.py's RowGrammars).
GRAMMAR_FIELDS = ("structured_output",)
ROW_FIELDS = (*WARPER_FIELDS, *PENALTY_FIELDS, *BIAS_FIELDS, *BAN_FIELDS, *GRAMMAR_FIELDS)


def warp_of(params: SamplingParams) -> SamplingParams:
    """The setting with its warpers (WARPER_FIELDS) only: what processed_probs reads."""
    return SamplingParams(**{name: getattr(params, name) for name in WARPER_FIELDS})


class RowSampling:
    """Each row's own sampling settings in one batch (rows that differ only in ROW_FIELDS).
    processed_probs / processed_logprobs warp each row by its own settings, one call per distinct
    setting; the verifier then tests every row against its own distribution, so each row is
    exact as it would be alone."""

    def __init__(self, rows: list[SamplingParams]):
        self.rows = list(rows)  # each row's settings, in row order
        # Each distinct warp -> its rows: the warpers only, so rows that differ in a penalty or a
        # bias alone (already in their logits) are warped in one call.
        self.groups: dict[SamplingParams, list[int]] = {}
        warps = {params: warp_of(params) for params in set(rows)}
        for i, params in enumerate(rows):
            self.groups.setdefault(warps[params], []).append(i)
        self.greedy = all(params.greedy for params in self.groups)
        self.lossy = any(params.lossy for params in warps)
        # Per device: each group's row indices, which rows are greedy, the penalties, the biases;
        # and the rows of each ban. The engine
        # keeps one RowSampling while its rows stay, and a round warps with it several times (each
        # drafted depth, the verification): each is built once.
        self._indices: dict[torch.device, list[tuple[SamplingParams, torch.Tensor]]] = {}
        self._greedy: dict[torch.device, torch.Tensor] = {}
        self._penalties: dict[torch.device, list] = {}
        self._biases: dict[torch.device, RowBiases | None] = {}
        self._bans: tuple | None = None

    def greedy_rows(self, device: torch.device) -> torch.Tensor:
        """(rows,) bool: which rows are greedy."""
        if device not in self._greedy:
            self._greedy[device] = torch.tensor([params.greedy for params in self.rows], device=device)
        return self._greedy[device]

    def apply(self, logits: torch.Tensor, warp) -> torch.Tensor:
        """warp(logits, params) on each group of rows (the first dim), put back in row order."""
        if logits.device not in self._indices:
            self._indices[logits.device] = [(params, torch.tensor(rows, device=logits.device))
                                            for params, rows in self.groups.items()]
        out = None
        for params, index in self._indices[logits.device]:
            part = warp(logits.index_select(0, index), params)
            if out is None:
                out = part.new_empty((logits.shape[0], *part.shape[1:]))
            out.index_copy_(0, index, part)
        return out


def row_penalties(params: SamplingParams | RowSampling, device) -> list[float | torch.Tensor | None]:
    """The (repetition, presence, frequency) penalties of one setting, or of each row's own: None
    where no row has one, the number when the rows share it, else a (rows,) float64 tensor of one
    per row (the neutral value, which changes nothing, where a row has none). The target pass and
    the drafters' draft penalties (drafters/repeats.py) both read them here."""
    if isinstance(params, SamplingParams):
        return _penalties_of([params], device)
    if device not in params._penalties:
        params._penalties[device] = _penalties_of(params.rows, device)
    return params._penalties[device]


def _penalties_of(rows: list[SamplingParams], device) -> list[float | torch.Tensor | None]:
    penalties = []
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        values = [neutral if getattr(p, name) is None else float(getattr(p, name)) for p in rows]
        if all(value == neutral for value in values):
            penalties.append(None)
        elif all(value == values[0] for value in values[1:]):
            penalties.append(values[0])
        else:
            penalties.append(torch.tensor(values, dtype=torch.float64, device=device))
    return penalties


class RowBiases(NamedTuple):
    """A logit bias for a block's (B, T, V) logits: `rows` None when every row has this one (ids,
    values), else entry i adds values[i] to token ids[i] of row rows[i] (a row's ids are distinct)."""
    rows: torch.Tensor | None
    ids: torch.Tensor
    values: torch.Tensor

    def add_(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits plus the bias, in place: each row's biased logits get exactly the
        arithmetic they get alone (the bias in the logits' dtype, added once)."""
        if self.rows is None:
            logits[..., self.ids] += self.values.to(logits.dtype)
        else:
            logits[self.rows, :, self.ids] += self.values.to(logits.dtype)[:, None]
        return logits


def row_biases(params: SamplingParams | RowSampling, device) -> RowBiases | None:
    """The logit bias of one setting, or of each row's own: None where no row has one."""
    if isinstance(params, SamplingParams):
        return None if not params.logit_bias else RowBiases(None, *params.bias_tensors(device))
    if device not in params._biases:
        biases = [p.logit_bias for p in params.rows]
        if all(bias == biases[0] for bias in biases[1:]):
            params._biases[device] = row_biases(params.rows[0], device)
        else:
            entries = [(row, t, b) for row, bias in enumerate(biases) for t, b in bias or ()]
            rows, ids, values = zip(*entries)
            params._biases[device] = RowBiases(torch.tensor(rows, device=device), torch.tensor(ids, device=device),
                                               torch.tensor(values, device=device))
    return params._biases[device]


def row_grammars(params: SamplingParams | RowSampling, rows: int) -> list | None:
    """Each row's structured_output, or None when no row has one (the usual case: one check)."""
    if isinstance(params, SamplingParams):
        return None if params.structured_output is None else [params.structured_output] * rows
    grammars = [row.structured_output for row in params.rows]
    return grammars if any(spec is not None for spec in grammars) else None


def row_bans(params: SamplingParams | RowSampling) -> tuple[dict, dict]:
    """The rows that ban n-grams, by n, and words, by word list (None: every row), for
    verifier/ngram_ban.py's BlockBans."""
    if isinstance(params, SamplingParams):
        return ({params.no_repeat_ngram_size: None} if params.bans_repeated_ngrams else {},
                {params.bad_words_ids: None} if params.bans_words else {})
    if params._bans is None:
        by_n: dict[int, list[int]] = {}
        by_words: dict[tuple, list[int]] = {}
        for b, row in enumerate(params.rows):
            if row.bans_repeated_ngrams:
                by_n.setdefault(row.no_repeat_ngram_size, []).append(b)
            if row.bans_words:
                by_words.setdefault(row.bad_words_ids, []).append(b)
        every = len(params.rows)
        params._bans = tuple({key: None if len(which) == every else which for key, which in groups.items()}
                             for groups in (by_n, by_words))
    return params._bans


def check_row_sampling(rows: list[SamplingParams]) -> None:
    """Rows may share a batch when their settings differ only in ROW_FIELDS; else a ValueError
    that names the settings that differ."""
    first, distinct = rows[0], set(rows)  # rows of a batch mostly repeat a few settings
    differ = sorted({name for params in distinct for name in first.__dataclass_fields__
                     if name not in ROW_FIELDS and getattr(params, name) != getattr(first, name)})
    if differ:
        raise ValueError(f"rows of one batch differ in {differ}: only {list(ROW_FIELDS)} can be set per row; "
                         "run rows with other values as batches of their own")
    if len(distinct) > 1 and first.lossy_typical_acceptance is not None:
        raise ValueError("lossy_typical_acceptance takes one sampling setting for the whole batch: give every row "
                         "the same temperature, top_k, ... or run them as batches of their own")


def processed_probs(logits: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities in float32 or better (float64 stays float64).
    RowSampling: each row (first dim) by its own settings."""
    if isinstance(params, RowSampling):
        return params.apply(logits, processed_probs)
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(work_dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(work_dtype)
    return _warped_scores(logits, params).softmax(-1)


def processed_logprobs(logits: torch.Tensor, params: SamplingParams | RowSampling) -> torch.Tensor:
    """(..., V) logits -> the log of the distribution a token is drawn from (float32 or better):
    -inf where top-k / top-p / min-p / typical-p / the cutoffs drop a token. At temperature 0, the
    log-softmax of the logits greedy takes the argmax of (vLLM's processed_logprobs does the same).
    RowSampling: each row (first dim) by its own settings."""
    if isinstance(params, RowSampling):
        return params.apply(logits, processed_logprobs)
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return (logits if params.greedy else _warped_scores(logits, params)).log_softmax(-1)


# Below this temperature logits / T can overflow (a logit of 10 at T = 1e-38 is inf in float32), and a
# softmax of inf is NaN: tempered shifts the logits by their maximum first. Above it no model's logits
# overflow, and the shift's extra pass over the vocabulary is saved.
SHIFT_BELOW_TEMPERATURE = 1e-4


def tempered(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """scores / temperature over the last dim, finite where the scores are: at a tiny temperature the
    scores are shifted so their maximum is 0 first (softmax does not change), so the likeliest tokens
    stay at 0 and the rest go to -inf, the distribution's exact limit."""
    if temperature >= SHIFT_BELOW_TEMPERATURE:
        return scores / temperature
    shifted = scores - scores.amax(-1, keepdim=True)
    return torch.where(shifted == 0, shifted, shifted / temperature)  # (a float32 5e-324 is 0: 0 / 0 is NaN)


def _warped_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-h, top-k, top-p, min-p, typical-p, epsilon and eta as -inf: the
    scores whose softmax is sampled. Each warper sees the scores the previous one left, as in
    Hugging Face."""
    # (At T=1 the division is the identity: skipping it saves a pass over the vocabulary per position.
    # No warper below writes in place, so the caller's logits are never changed.)
    scores = logits if params.temperature == 1.0 else tempered(logits, params.temperature)
    if params.top_h is not None:
        scores = _top_h(scores, params.top_h)
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))  # ties with the k-th are kept
    if params.top_p is not None and params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    if params.min_p is not None and params.min_p > 0.0:
        probs = scores.softmax(-1)
        drop = probs < params.min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(-1, probs.argmax(-1, keepdim=True), False)  # always keep the most likely token
        scores = scores.masked_fill(drop, float("-inf"))
    if params.typical_p is not None and params.typical_p < 1.0:
        scores = _typical(scores, params.typical_p)
    if params.epsilon_cutoff:
        scores = _below_cutoff(scores, lambda entropy: params.epsilon_cutoff)
    if params.eta_cutoff:
        eta = params.eta_cutoff
        scores = _below_cutoff(scores, lambda entropy: torch.clamp(eta ** 0.5 * torch.exp(-entropy), max=eta))
    return scores


SORT_CANDIDATES = 1024  # tokens top-p and typical-p sort first (the whole vocabulary only where they fall short)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Hugging Face's top-p over the last dim: a token is dropped (-inf) where the tokens ranked
    above it hold at least top_p of the mass; the likeliest is always kept. Tokens of equal score
    rank by id, the lower first (torch.sort's unstable order, which Hugging Face leaves them in,
    may differ between a row alone and in a batch: plain decoding and the verifier must agree).

    Sorting a 152k vocabulary costs about 13 ms a position on a 2-core CPU, and the verifier warps
    every node of a tree. So it ranks only the likeliest SORT_CANDIDATES (torch.topk, about 1 ms)
    where the tokens scoring above the last of them hold top_p of the mass: every token scoring
    no more than it is then dropped in any order. Other rows (flat distributions) rank the whole
    vocabulary."""
    flat = scores.reshape(-1, scores.shape[-1])
    every_prob = flat.softmax(-1)
    values, ids = _ranked(flat, min(SORT_CANDIDATES, flat.shape[-1]))
    probs = every_prob.gather(-1, ids)
    drop = torch.ones_like(flat, dtype=torch.bool).scatter_(-1, ids, _ranked_drop(probs, top_p))
    short = (probs * (values > values[:, -1:])).sum(-1) < top_p  # the boundary may lie past the candidates
    if bool(short.any()):
        values, ids = _ranked(flat[short], flat.shape[-1])  # ids: every token of the row
        ranked_drop = _ranked_drop(every_prob[short].gather(-1, ids), top_p)
        drop[short] = torch.empty_like(ranked_drop).scatter_(-1, ids, ranked_drop)
    return flat.masked_fill(drop, float("-inf")).reshape(scores.shape)


def _ranked(flat: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` likeliest scores of each row and their token ids, likeliest first, ties by id."""
    if count < flat.shape[-1]:
        ids = torch.topk(flat, count, dim=-1).indices.sort(dim=-1).values  # in id order for the stable sort
        values, order = torch.sort(flat.gather(-1, ids), dim=-1, descending=True, stable=True)
        return values, ids.gather(-1, order)
    return torch.sort(flat, dim=-1, descending=True, stable=True)


def _ranked_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Over probabilities ranked likeliest first: True where those ranked above hold top_p."""
    cumulative = probs.cumsum(-1)
    return torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], -1) >= top_p  # never the first


TOP_H_CANDIDATES = 100  # Hugging Face's top_n: the tokens top-H looks at


def _top_h(scores: torch.Tensor, top_h: float) -> torch.Tensor:
    """Hugging Face's TopHLogitsWarper over the last dim, with its operations: over the likeliest
    100 tokens renormalised, keep them in order while the cumulative entropy -p log p stays within
    top_h x their entropy (the likeliest always); the rest, and every token past the 100, -inf."""
    top_logits, top_index = torch.topk(scores, min(TOP_H_CANDIDATES, scores.shape[-1]), dim=-1)
    dist = torch.distributions.Categorical(logits=top_logits)
    probs = dist.probs
    cumulative = torch.cumsum(-probs * torch.log(probs), dim=-1)
    keep_top = cumulative <= (dist.entropy() * top_h).unsqueeze(-1)
    keep_top[..., 0] = True
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top_index, keep_top)
    return scores.masked_fill(~keep, float("-inf"))


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Hugging Face's TypicalLogitsWarper over the last dim: sort tokens by how far their surprise
    (-log p) is from the entropy, keep them up to and including the one where the cumulative
    probability reaches `mass`; ties with that one are kept. What is kept depends on that one's
    distance only (not on the order of ties), so, as for top-p, the SORT_CANDIDATES nearest
    tokens are sorted first and suffice where they hold `mass`; other rows sort the whole
    vocabulary."""
    log_probs = scores.log_softmax(-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(-1, keepdim=True)  # nansum: dropped tokens give -inf x 0
    distance = (-log_probs - entropy).abs()
    flat_distance, flat_probs = distance.reshape(-1, distance.shape[-1]), probs.reshape(-1, probs.shape[-1])
    flat_scores = scores.reshape(-1, scores.shape[-1])
    near, ids = torch.topk(flat_distance, min(SORT_CANDIDATES, flat_distance.shape[-1]), dim=-1, largest=False)
    cumulative = flat_probs.gather(-1, ids).cumsum(-1)  # nearest first
    threshold = _typical_threshold(near, cumulative, mass)
    short = cumulative[:, -1] < mass  # the one reaching `mass` may lie past the candidates
    if bool(short.any()):
        near, order = torch.sort(flat_distance[short], descending=False)
        # (Hugging Face's own sums: a softmax of the sorted scores)
        threshold[short] = _typical_threshold(near, flat_scores[short].gather(-1, order).softmax(-1).cumsum(-1), mass)
    return scores.masked_fill(distance > threshold.reshape(*distance.shape[:-1], 1), float("-inf"))


def _typical_threshold(near: torch.Tensor, cumulative: torch.Tensor, mass: float) -> torch.Tensor:
    """Over distances sorted nearest first and their cumulative probability: the distance of the
    token where it reaches `mass` (the last one if it never does). (rows, 1)."""
    last = (cumulative < mass).sum(-1, keepdim=True).clamp(max=near.shape[-1] - 1)
    return near.gather(-1, last)


def _below_cutoff(scores: torch.Tensor, cutoff) -> torch.Tensor:
    """Hugging Face's epsilon / eta warpers: drop tokens whose probability is below
    cutoff(entropy), except the most likely (ties with it kept)."""
    log_probs = scores.log_softmax(-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(-1, keepdim=True)
    drop = (probs < cutoff(entropy)) & (scores < scores.amax(-1, keepdim=True))
    return scores.masked_fill(drop, float("-inf"))


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """Hugging Face's repetition penalty on (..., V) logits, seen (..., V) = the tokens already in
    each position's context: their positive logits are divided by `penalty`, negative ones
    multiplied. In float32 or better, as Hugging Face's generate computes it. penalty: one
    number, or a (B,) tensor of one per row (the first dim)."""
    logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits.clone()
    # Only the seen entries change: indexing them beat two full-size torch.where's 3-5x at batch 8.
    at = seen.nonzero(as_tuple=True)
    values = logits[at]
    if isinstance(penalty, torch.Tensor):
        penalty = penalty.to(logits.dtype)[at[0]]
    logits[at] = torch.where(values < 0, values * penalty, values / penalty)
    return logits


def token_mask(rows: list[list[int]], width: int, device) -> torch.Tensor:
    """(B, width) bool: the token ids each row holds (a row's committed context, for the penalty)."""
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        mask[b, torch.tensor(row, dtype=torch.long)] = True
    return mask.to(device)


def penalize_counts(logits: torch.Tensor, counts: torch.Tensor, presence: float | None,
                    frequency: float | None) -> torch.Tensor:
    """vLLM's presence and frequency penalties on (..., V) logits, counts (..., V) = how often each
    token was generated in each position's context: logits - frequency x count - presence x [count > 0]."""
    logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    counts = counts.to(logits.dtype)
    frequency, presence = (0.0 if value is None else value for value in (frequency, presence))
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: (B, V) probabilities (not necessarily normalised) and (B,) uniforms in
    [0, 1) -> (B,) token ids. Tokens of zero probability are never returned."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:].contiguous()
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * total
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total (idx past the end): take the token at which the CDF first
    # reaches its total, which has mass (a second search, not another pass over the vocabulary).
    return torch.minimum(idx, torch.searchsorted(cdf, total).squeeze(-1))


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample one token per row of (B, V) probabilities with an explicit generator."""
    u = torch.rand(probs.shape[:-1], generator=generator, device=generator.device, dtype=torch.float64)
    return sample_from(probs, u.to(probs.device))
