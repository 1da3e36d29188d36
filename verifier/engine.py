"""The generation loop shared by every drafter: draft, verify in one target pass, commit, repeat.

A round, per active row: the root (newest emitted token, not yet cached) and the drafter's tree go
through the target together; the verifier picks the accepted path and one more token; the target
cache keeps the root and the accepted path; the drafter is told what happened. Rows that end (EOS,
a stop string, max_new_tokens, context limit, or the caller aborting them) leave the batch.
"""
from __future__ import annotations

import numbers
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Container, Iterable, Iterator

import torch

from ..drafters.base import Drafter, DraftTree, RoundFeedback
from .cached_model import CachedLM
from .context_tokens import ContextTokens
from .logprobs import TokenLogprobs
from .rejection import GeneratorCoin, verify_greedy, verify_greedy_chains, verify_plain, verify_sampled
from .typical import verify_typical
from .block_penalties import penalize_block_counts_, penalize_block_repeats_
from .grammar import DraftGrammar, GrammarCompiler, RowGrammars
from .ngram_ban import BlockBans
from .joining import BATCH, JoiningRow, PendingJoin
from .prefill import Prefill
from .sampling import (RowSampling, SamplingParams, check_row_sampling, processed_probs, row_bans, row_biases,
                       row_grammars,
                       row_penalties)
from .tree import TreeBlock, pack_drafts, verification_block


# stop(tokens so far, this round's new tokens) -> new tokens to keep (the row ends), or None.
StopCheck = Callable[[list[int], list[int]], "int | None"]
# joining() -> rows that join a running batch before its next round (verifier/joining.py's
# JoiningRow, or plain tuples in its order): the settings a row leaves out are the batch's.
Joining = Callable[[], "list[JoiningRow | tuple]"]


def per_row(value) -> bool:
    """Whether a list setting is one list per row rather than one list for all: stop strings or
    stop_token_ids per row are a list of lists (or of None: the row has none)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and \
        all(item is None or isinstance(item, (list, tuple, set, frozenset)) for item in value)


@dataclass
class GenerationStats:
    rounds: int = 0  # target passes after the prefill (one per round, whole batch)
    row_rounds: int = 0  # sum over rows of the rounds each took part in
    new_tokens: int = 0
    accepted_per_round: list[list[int]] = field(default_factory=list)  # per row, accepted drafts each round
    proposed_at_depth: list[int] = field(default_factory=list)  # row-rounds with a node at depth d+1
    accepted_at_depth: list[int] = field(default_factory=list)  # row-rounds that accepted depth d+1
    proposed_tokens: int = 0  # draft tokens (tree nodes) verified, over all row-rounds
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reasons: list[str] = field(default_factory=list)  # per row: eos | stop | length | context | abort
    drafter_report: dict = field(default_factory=dict)  # the drafter's own report(), e.g. cascade usage
    lossy: bool = False  # drafts were accepted by typical acceptance: not the target's distribution

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass per row, the bonus token included."""
        return self.new_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at_depth, self.proposed_at_depth)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "row_rounds": self.row_rounds, "new_tokens": self.new_tokens,
            "tau": self.tau, "per_position_acceptance": self.per_position_acceptance,
            "accepted_per_round": self.accepted_per_round, "proposed_tokens": self.proposed_tokens,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds, "tokens_per_second": self.tokens_per_second,
            "finish_reasons": self.finish_reasons, "drafter_report": self.drafter_report, "lossy": self.lossy,
        }

    def _count_depths(self, tree: DraftTree, num_accepted: int) -> None:
        self.proposed_tokens += tree.size
        deepest = max(tree.depths(), default=0)
        while len(self.proposed_at_depth) < deepest:
            self.proposed_at_depth.append(0)
            self.accepted_at_depth.append(0)
        for d in range(deepest):
            self.proposed_at_depth[d] += 1
            self.accepted_at_depth[d] += int(d < num_accepted)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeEngine:
    def __init__(self, target: torch.nn.Module, drafter: Drafter, eos_token_ids: set[int], max_context: int,
                 context_note: str = ""):
        # Its sliding / chunked layers hold about a window (and what a drafter reading them needs).
        self.target = CachedLM(target, trim_windows=True, trim_margin=drafter.needs.target_cache_margin)
        if drafter.needs.target_cache:  # it reads the target's keys (drafters/base.py TargetNeeds)
            drafter.attach_target_cache(self.target)
        self.drafter = drafter
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.context_note = context_note  # why max_context is short of the target's own, when it is
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.device = self.target.device
        self._context_seen = self._generated_counts = self._bans = None  # per request
        self._minimums: list[int] = []  # per request: each row's min_new_tokens, by row number
        self._stops: list[StopCheck | None] = []  # per request: each row's stop check
        self._row_end_ids: list[frozenset[int]] = []  # per request: each row's EOS (unless ignored) and stop ids
        self._end_ids = frozenset(self.eos_token_ids)  # per request: every row's, together
        # per request: what a joining row that gives none takes: min_new_tokens, stop check, stop
        # token ids, ignore_eos (the batch's one value, else none / False when its rows had their
        # own) and sampling settings (the batch's, or its drafter's when its rows had their own)
        self._join_defaults: tuple = (0, None, frozenset(), False, None)
        self._row_sampling: list[SamplingParams] = []  # per request: each row's sampling settings, by row number
        self._one_sampling: SamplingParams | None = None  # per request: the setting every row has, if one
        # per request: the rows of the last round and their settings (_sampling_of), kept while
        # the same rows run, so a mixed batch builds its RowSampling only when rows join or leave
        self._round: tuple[tuple[int, ...], SamplingParams | RowSampling] | None = None
        self._logprobs_mode = None  # per request: None, or the mode logprobs are asked for in
        # Tokens per row and round that a joining prompt's prefill takes (chunked prefill,
        # verifier/prefill.py); None: the whole prompt before the next round, as a batch's start does.
        self.join_prefill_chunk: int | None = None
        # Compiles structured_output grammars for the target's tokenizer (verifier/grammar.py); set
        # by whoever holds the tokenizer (draftsman.load); None: structured output is refused.
        self.grammars: GrammarCompiler | None = None
        self._row_grammars: RowGrammars | None = None  # per request: each row's matcher
        # Drafters draft within each row's grammar (Drafter.grammar); False leaves drafts free, to
        # measure what that buys (scripts/grammar_drafts_experiment.py). Exact either way.
        self.draft_within_grammar = True
        # A target with recurrent layers reads each row's tree as its branches, a row each
        # (verifier/branches.py): this many per round, shared by the rows (each reads max(1, N //
        # rows)). Each costs a copy of its row's cache and a row of the pass: on a 2-core CPU two
        # paid at batch 1 and lost at batch 4 (scripts/hybrid_branches_experiment.py).
        self.recurrent_branches = 2

    def check_prompts(self, prompts: list[list[int]], generates: bool = True) -> None:
        """generates False: the prompts are only scored (one pass, which fills the whole context)."""
        if not prompts:
            raise ValueError("no prompts given: pass at least one prompt (text or token ids)")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the BOS token)")
            if not generates and len(p) > self.max_context:
                raise ValueError(f"prompt {i} has {len(p)} tokens but the target's context is {self.max_context} "
                                 f"positions: shorten it to at most {self.max_context} tokens"
                                 + (f" ({self.context_note})" if self.context_note else ""))
            if generates and len(p) >= self.max_context:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens but the target's context is {self.max_context} "
                    f"positions, leaving no room to generate: shorten it to at most {self.max_context - 1} tokens"
                    + (f" ({self.context_note})" if self.context_note else ""))
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the target's vocabulary "
                                 f"[0, {self.vocab_size})")

    def check_stop_token_ids(self, ids: Iterable[int]) -> frozenset[int]:
        if ids is None:
            return frozenset()
        if not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, e.g. [2], got {ids!r}")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are not token ids of the target's vocabulary "
                             f"[0, {self.vocab_size}): give integer ids, "
                             "e.g. tokenizer.convert_tokens_to_ids('<|im_end|>')")
        return frozenset(ids)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 sampling: SamplingParams | list[SamplingParams],
                 seed: int = 0, stop: StopCheck | list[StopCheck | None] | None = None, min_new_tokens: int = 0,
                 logprobs: TokenLogprobs | None = None,
                 stop_token_ids: Iterable[int] | list[Iterable[int]] = (),
                 ignore_eos: bool | list[bool] = False) -> tuple[list[list[int]], GenerationStats]:
        """New tokens per row (EOS or the stop token included when it ended the row) and the run's
        statistics; `logprobs` filled as in stream()."""
        stats = GenerationStats()
        outputs: list[list[int]] = [[] for _ in prompts]
        for row, tokens in self.stream(prompts, max_new_tokens, sampling, seed, stats, stop, min_new_tokens,
                                       logprobs, stop_token_ids, ignore_eos=ignore_eos):
            outputs[row] += tokens
        return outputs, stats

    @torch.no_grad()
    def stream(self, prompts: list[list[int]], max_new_tokens: int | list[int],
               sampling: SamplingParams | list[SamplingParams],
               seed: int = 0, stats: GenerationStats | None = None,
               stop: StopCheck | list[StopCheck | None] | None = None, min_new_tokens: int | list[int] = 0,
               logprobs: TokenLogprobs | None = None,
               stop_token_ids: Iterable[int] | list[Iterable[int]] = (),
               aborted: Container[int] = (), joining: Joining | None = None,
               ignore_eos: bool | list[bool] = False) -> Iterator[tuple[int, list[int]]]:
        """Yields (row, tokens) as each round commits them, after the round is counted in `stats`;
        a row that ended in the round has its finish reason in `stats` when it is yielded, and is
        yielded even with no new token (tokens []). max_new_tokens:
        one limit for every row, or one per row (requests with different limits in one batch). stop(tokens so
        far, new tokens) -> how many new tokens to keep when the row must stop there, else None
        (draftsman/stop.py: text stop strings). min_new_tokens: EOS cannot end a row before it has
        that many new tokens (Hugging Face's min_new_tokens, vLLM's min_tokens); one number for
        every row, or one per row as max_new_tokens. logprobs: gets the
        target's log-probability of each token before that token is yielded (verifier/logprobs.py).
        stop_token_ids: tokens that end a row as EOS does (kept in its output; finish reason "stop"),
        as vLLM's stop_token_ids; min_new_tokens holds them back too. stop and stop_token_ids: one
        for every row, or a list of one per row (requests with their own stops in one batch; a
        row's stop None: no stop check). aborted: rows the caller wants
        ended (e.g. a set it adds to while the stream runs, when a client goes away): each leaves
        the batch after the round it is in, finish reason "abort", so it costs no more target passes.
        joining: asked before every round for rows that join the batch (continuous batching, as
        vLLM's scheduler adds requests at every step): each is prefilled and then runs as if it had
        been there from the start, numbered after the rows before it. A joining row is a
        JoiningRow (verifier/joining.py) or a tuple in its order (token ids, max_new_tokens[,
        min_new_tokens[, stop[, stop_token_ids[, sampling[, ignore_eos]]]]]); a minimum, stops or
        ignore_eos it does not give are the batch's one (none when the batch had one per row),
        sampling settings the batch's (its drafter's when the batch had one per row); check_rows()
        tells whether it is valid. Needs a drafter that can add rows (Drafter.can_add_rows).
        ignore_eos: vLLM's; EOS ends no row (nor is it held back: it is drawn as any token), so
        rows end at their stops or limits; one for every row, or one per row. sampling: one for
        every row, or one per row that differ only in verifier/sampling.py's ROW_FIELDS
        (temperature, top_k, top_p, ..., the penalties, logit_bias, the bans): each row is verified against its own
        distribution; the drafter drafts in the shape the settings most rows have pick, each
        row's draws under its own where it can (exact either way, as the verifier tests any draft
        against each row's own)."""
        if joining is not None and not self.drafter.can_add_rows:
            raise ValueError(f"drafter '{self.drafter.name}' cannot take rows into a running batch "
                             "(it does not implement Drafter.add_rows): run the rows as batches of their own")
        self.check_prompts(prompts)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):  # (torch's error names a "long")
            raise ValueError(f"seed must be a whole number, e.g. 0, got {seed!r}")
        if not -2**63 <= seed < 2**64:  # what torch.Generator takes ("Overflow when unpacking long long")
            raise ValueError(f"seed must be in [-2^63, 2^64), the range a torch generator takes, got {seed}")
        ignored = self._row_ignore_eos(ignore_eos, len(prompts))
        self._row_end_ids = self._row_stop_token_ids(stop_token_ids, ignored)
        self._end_ids = frozenset().union(*self._row_end_ids)
        self._stops = self._row_stops(stop, len(prompts))
        self._row_sampling = self._row_sampling_of(sampling, len(prompts))
        counts = Counter(self._row_sampling)
        drafter_sampling = counts.most_common(1)[0][0]  # the first of the likeliest
        self._one_sampling = drafter_sampling if len(counts) == 1 else None
        self._round = None
        sampling = self._row_sampling[0]  # what rows share: typical acceptance
        self._check_token_ids(counts)
        if logprobs is not None and len(logprobs.values) != len(prompts):
            raise ValueError(f"logprobs holds {len(logprobs.values)} rows for {len(prompts)} prompts")
        self._logprobs_mode = logprobs.mode if logprobs is not None else None
        limits = self._row_limits(max_new_tokens, len(prompts))
        self._minimums = self._row_minimums(min_new_tokens, limits)
        self._check_structured(self._row_sampling, self._minimums, ignored)
        self._row_grammars = None
        self._join_defaults = (min_new_tokens if isinstance(min_new_tokens, int) else 0,
                               None if isinstance(stop, (list, tuple)) else stop,
                               frozenset() if per_row(stop_token_ids) else self.check_stop_token_ids(stop_token_ids),
                               ignore_eos if isinstance(ignore_eos, bool) else False,
                               drafter_sampling)
        stats = stats if stats is not None else GenerationStats()
        stats.accepted_per_round = [[] for _ in prompts]
        stats.finish_reasons = [""] * len(prompts)
        stats.lossy = sampling.lossy
        t_start = time.perf_counter()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        coin = GeneratorCoin(generator)
        B = len(prompts)
        contexts = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        active = list(range(B))  # original row index of each active row
        # Under penalties: the tokens each active row's context holds, and how often each was
        # generated, kept up to date with each round's tokens (not rebuilt from whole rows); made
        # when a round's rows first need them (_target_pass).
        self._context_seen = self._generated_counts = None
        self._bans = BlockBans(self.eos_token_ids)  # each row's n-gram and word bans, indexed as rows need them

        # 1. Prefill all but the last prompt token: that one is the first round's root.
        layers = self.drafter.needs.hidden_state_layers
        prefill_hidden = self._prefill(contexts, layers)
        self.drafter.token_budget = limits  # the engine's own list, extended as rows join
        self.drafter.min_new_tokens, self.drafter.eos_token_ids = self._drafter_minimums(range(B)), self._end_ids
        self.drafter.begin([list(p) for p in prompts], drafter_sampling, generator)
        if layers:
            self.drafter.observe_prefill(prefill_hidden)

        try:
            pending: list[PendingJoin] = []  # joined rows whose prompts are being prefilled
            while active or pending or joining is not None:
                if joining is not None:  # rows that join before this round
                    joined = joining()
                    if joined:
                        pending.append(self._start_join(joined, contexts, outputs, limits, stats, logprobs))
                    elif not active and not pending:
                        break
                if pending:
                    active += self._advance_joins(pending, whole=not active)
                if not active:
                    continue
                # 2. Draft, clipped so no row runs past max_new_tokens or the context.
                self.drafter.min_new_tokens = self._drafter_minimums(active)
                round_sampling = self._sampling_of(active)
                # Rows with settings of their own: drafters that draw may draw each row under them.
                self.drafter.row_sampling = None if round_sampling == self.drafter.sampling else round_sampling
                self.drafter.grammar = self._draft_grammar(active, round_sampling, outputs)
                synchronize(self.device)
                t0 = time.perf_counter()
                trees = self.drafter.propose([contexts[r] for r in active])
                branches = max(1, self.recurrent_branches // len(active))
                for i, r in enumerate(active):
                    room = min(limits[r] - len(outputs[r]), self.max_context - len(contexts[r]))
                    trees[i] = trees[i].truncated_to_depth(room - 1)
                    if self.target.recurrent:  # it reads a tree as its branches (verifier/branches.py)
                        trees[i] = trees[i].first_branches(branches)
                synchronize(self.device)
                t1 = time.perf_counter()

                # 3. One target pass over every row's root + tree, then accept/reject.
                roots = torch.tensor([contexts[r][-1] for r in active], dtype=torch.long)
                verdict, hidden, block_tokens, logprob_logits, target_top = self._verify(
                    roots, trees, round_sampling, coin, [contexts[r] for r in active], [outputs[r] for r in active],
                    active)
                accepted = verdict.accepted.tolist()
                num_accepted = verdict.num_accepted.tolist()
                next_token = verdict.next_token.tolist()
                synchronize(self.device)
                t2 = time.perf_counter()

                # 4. Commit: emitted tokens, EOS / length / context stops, cache and drafter rollback.
                paths = [accepted[i][: num_accepted[i]] for i in range(len(active))]
                # Block slots of the root and the accepted path: slot j's logits chose token j.
                keep_slots = [[0] + [n + 1 for n in path] for path in paths]
                round_tokens = [trees[i].tokens[path].tolist() + [next_token[i]] if path else [next_token[i]]
                                for i, path in enumerate(paths)]
                round_logprobs = (logprobs.read(logprob_logits, keep_slots, round_tokens, round_sampling)
                                  if logprobs is not None else None)
                emitted_rows, still = [], []
                for i, r in enumerate(active):
                    emitted, reason = self._clip(round_tokens[i], len(outputs[r]), len(contexts[r]), limits[r],
                                                 self._row_end_ids[r])
                    keep = self._stops[r](outputs[r], emitted) if self._stops[r] is not None and emitted else None
                    if keep is not None:  # the row ends like EOS: its cache and drafter rows go below
                        emitted, reason = emitted[:keep], "stop"
                    if not reason and r in aborted:  # its tokens so far stand; it takes no more rounds
                        reason = "abort"
                    outputs[r] += emitted
                    contexts[r] += emitted
                    if logprobs is not None:
                        logprobs.keep(r, round_logprobs, i, len(emitted))
                    stats.accepted_per_round[r].append(num_accepted[i])
                    stats._count_depths(trees[i], num_accepted[i])
                    stats.new_tokens += len(emitted)
                    emitted_rows.append(emitted)
                    if reason:
                        stats.finish_reasons[r] = reason
                    else:
                        still.append(i)
                self.target.accept(keep_slots)
                feedback = RoundFeedback(paths, emitted_rows, self._kept_hidden(hidden, keep_slots),
                                         verify_seconds=t2 - t1, block_tokens=block_tokens, target_top=target_top)
                self.drafter.observe(feedback)
                stats.rounds += 1
                stats.row_rounds += len(active)
                committed = list(zip(active, emitted_rows))  # (active narrows below)
                if len(still) < len(active):
                    self.target.select_rows(still)
                    self.drafter.keep_rows(still)
                    for table in (self._context_seen, self._generated_counts):
                        if table is not None:
                            table.select_rows(still)
                    active = [active[i] for i in still]
                stats.draft_seconds += t1 - t0
                stats.verify_seconds += t2 - t1
                synchronize(self.device)
                stats.total_seconds = time.perf_counter() - t_start
                # Yielded once the round is counted: a consumer that answers a request on its rows'
                # ends (serve) answers it now, with stats that count its last round, not a round later.
                for r, emitted in committed:
                    if emitted or stats.finish_reasons[r]:
                        yield r, emitted
        finally:  # once, when the loop ends or a stream's consumer stops early: not a per-round cost
            stats.drafter_report = self.drafter.report()

    def check_rows(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                   min_new_tokens: int | list[int], stop_token_ids: Iterable[int] | list[Iterable[int]] = (),
                   sampling: SamplingParams | list[SamplingParams] | None = None,
                   ignore_eos: bool | list[bool] = False) -> None:
        """Raise ValueError, naming the problem, when these rows cannot join a batch with these
        limits, stop token ids, sampling settings and ignore_eos (what stream() checks before it starts)."""
        self.check_prompts(prompts)
        minimums = self._row_minimums(min_new_tokens, self._row_limits(max_new_tokens, len(prompts)))
        ignored = self._row_ignore_eos(ignore_eos, len(prompts))
        self._row_stop_token_ids(stop_token_ids, ignored)
        if sampling is not None:
            settings = self._row_sampling_of(sampling, len(prompts))
            self._check_token_ids(set(settings))
            self._check_structured(settings, minimums, ignored)

    @staticmethod
    def _row_sampling_of(sampling, rows: int) -> list[SamplingParams]:
        """Each row's sampling settings: one for all, or a list of one per row that may differ
        only in ROW_FIELDS (verifier/sampling.py: all but typical acceptance)."""
        if isinstance(sampling, SamplingParams):
            return [sampling] * rows
        if not isinstance(sampling, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sampling):
            raise ValueError(f"sampling must be a SamplingParams, or a list of one per row, got {sampling!r}")
        if len(sampling) != rows:
            raise ValueError(f"sampling has {len(sampling)} settings for {rows} rows: give one, or one per row")
        check_row_sampling(list(sampling))
        return list(sampling)

    def _check_token_ids(self, settings: Iterable[SamplingParams]) -> None:
        """The token ids of every setting's logit_bias and bad_words_ids are in the vocabulary."""
        for name, ids_of in (("logit_bias", lambda p: [t for t, _ in p.logit_bias or ()]),
                             ("bad_words_ids", lambda p: [t for word in p.bad_words_ids or () for t in word])):
            outside = sorted({t for params in settings for t in ids_of(params) if t >= self.vocab_size})
            if outside:
                raise ValueError(f"{name} has token ids {outside[:5]} outside the target's vocabulary "
                                 f"[0, {self.vocab_size}): drop them")
        for params in settings:  # else every score is -inf and the "choice" is whatever id 0 is
            if len({word[0] for word in params.bad_words_ids or () if len(word) == 1}) == self.vocab_size:
                raise ValueError(f"bad_words_ids ban every one of the target's {self.vocab_size} tokens on its own, "
                                 "leaving none to generate: ban fewer")

    def _check_structured(self, settings: list[SamplingParams], minimums: list[int], ignored: list[bool]) -> None:
        """Each row's structured_output compiles, and the row lets its grammar decide where it
        ends (no min_new_tokens, no ignore_eos: both hold EOS back where the grammar may need it)."""
        specs = {params.structured_output for params in settings} - {None}
        if not specs:
            return
        if self.grammars is None:
            raise ValueError("structured_output needs the target's tokenizer and this target has none: "
                             "add its tokenizer files to the target folder")
        for row, (params, least, ignore) in enumerate(zip(settings, minimums, ignored)):
            if params.structured_output is not None and (least or ignore):
                name = f"min_new_tokens={least}" if least else "ignore_eos"
                raise ValueError(f"structured_output ends a row where its grammar is complete, and {name} "
                                 f"(row {row}) holds EOS back: drop one of them")
        for spec in specs:
            self.grammars.check(spec)

    def _sampling_of(self, rows: list[int]) -> SamplingParams | RowSampling:
        """The rows' sampling settings this round: the one they share, or each row's own. A request
        whose rows all came with one setting (the usual one) costs no per-row work a round; a
        mixed one builds them again only when its rows change."""
        if self._one_sampling is not None:
            return self._one_sampling
        key = tuple(rows)
        if self._round is None or self._round[0] != key:
            params = [self._row_sampling[r] for r in rows]
            self._round = key, params[0] if all(p == params[0] for p in params[1:]) else RowSampling(params)
        return self._round[1]

    def _row_stop_token_ids(self, stop_token_ids, ignored: list[bool]) -> list[frozenset[int]]:
        """Each row's end tokens: EOS unless the row ignores it, and its stop_token_ids (one list
        for all, or one per row)."""
        rows = len(ignored)
        if not per_row(stop_token_ids):
            stop_ids = [self.check_stop_token_ids(stop_token_ids)] * rows
        elif len(stop_token_ids) != rows:
            raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {rows} rows: give one list "
                             "of token ids, or one per row")
        else:
            stop_ids = [self.check_stop_token_ids(ids) for ids in stop_token_ids]
        return [self._eos_of(ignore) | ids for ignore, ids in zip(ignored, stop_ids)]

    def _eos_of(self, ignore_eos: bool) -> frozenset[int]:
        """The EOS ids that end a row: none when it ignores EOS."""
        return frozenset() if ignore_eos else self.eos_token_ids

    @staticmethod
    def _row_ignore_eos(ignore_eos, rows: int) -> list[bool]:
        """ignore_eos as one flag per row: one for all, or a list of one per row."""
        flags = list(ignore_eos) if isinstance(ignore_eos, (list, tuple)) else [ignore_eos] * rows
        if len(flags) != rows:
            raise ValueError(f"ignore_eos has {len(flags)} values for {rows} rows: give one, or one per row")
        bad = [flag for flag in flags if not isinstance(flag, bool)]
        if bad:
            raise ValueError(f"ignore_eos must be true or false, got {bad[0]!r}")
        return flags

    @staticmethod
    def _row_stops(stop, rows: int) -> list:
        """Each row's stop check: one for all, or a list of one per row."""
        if not isinstance(stop, (list, tuple)):
            return [stop] * rows
        if len(stop) != rows:
            raise ValueError(f"stop has {len(stop)} checks for {rows} rows: give one, or one per row")
        return list(stop)

    @staticmethod
    def _row_minimums(min_new_tokens, limits: list[int]) -> list[int]:
        """min_new_tokens as one number per row, each checked against its row's max_new_tokens."""
        if isinstance(min_new_tokens, (list, tuple)):
            if len(min_new_tokens) != len(limits):
                raise ValueError(f"min_new_tokens has {len(min_new_tokens)} values for {len(limits)} rows: "
                                 "give one number, or one per row")
            for row, (least, limit) in enumerate(zip(min_new_tokens, limits)):
                if isinstance(least, bool) or not isinstance(least, int):
                    raise ValueError(f"min_new_tokens must be a whole number, got {least!r} (row {row})")
                if not 0 <= least <= limit:
                    raise ValueError(f"min_new_tokens must be in [0, max_new_tokens = {limit}], got {least!r} "
                                     f"(row {row}): raise max_new_tokens or lower min_new_tokens")
            return list(min_new_tokens)
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int):
            # ("1" read as out of range, with "raise max_new_tokens" as the fix)
            raise ValueError(f"min_new_tokens must be a whole number, got {min_new_tokens!r}")
        if not 0 <= min_new_tokens <= min(limits):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens = {min(limits)}], got {min_new_tokens}: "
                             "raise max_new_tokens or lower min_new_tokens")
        return [min_new_tokens] * len(limits)

    def _drafter_minimums(self, rows) -> int | list[int]:
        """The rows' min_new_tokens as drafters read it: one number when they share it (as
        before rows could differ; a drafter written for that keeps working), else one per row."""
        minimums = [self._minimums[r] for r in rows]
        return minimums[0] if len(set(minimums)) == 1 else minimums

    def _start_join(self, joined: list[JoiningRow | tuple], contexts: list[list[int]], outputs: list[list[int]],
                    limits: list[int], stats: GenerationStats, logprobs: TokenLogprobs | None) -> PendingJoin:
        """Rows join the running batch: numbered and every per-row table extended now; their
        prompts prefilled apart, a chunk per round (_advance_joins), before they enter it."""
        joined = [JoiningRow.of(row) for row in joined]
        least, stop, stop_ids, ignore, sampling = self._join_defaults
        prompts = [list(map(int, row.prompt)) for row in joined]
        new_limits = [row.max_new_tokens for row in joined]
        new_minimums = [least if row.min_new_tokens is None else row.min_new_tokens for row in joined]
        new_sampling = [sampling if row.sampling is None else row.sampling for row in joined]
        ignored = self._row_ignore_eos([ignore if row.ignore_eos is None else row.ignore_eos for row in joined],
                                       len(joined))
        self.check_rows(prompts, new_limits, new_minimums)
        check_row_sampling([self._row_sampling[0], *new_sampling])  # they share the batch's typical acceptance
        self._check_token_ids(set(new_sampling))
        self._check_structured(new_sampling, new_minimums, ignored)
        new_end_ids = [self._eos_of(ignore_row) | (stop_ids if row.stop_token_ids is BATCH
                                                   else self.check_stop_token_ids(row.stop_token_ids))
                       for row, ignore_row in zip(joined, ignored)]
        first = len(contexts)
        fresh = CachedLM(self.target.model, self.target.dtype)
        prefill = Prefill(fresh, prompts, self.drafter.needs.hidden_state_layers, self.device)
        contexts += [list(p) for p in prompts]
        outputs += [[] for _ in prompts]
        limits += new_limits
        self._minimums += new_minimums
        self._stops += [stop if row.stop is BATCH else row.stop for row in joined]
        self._row_end_ids += new_end_ids
        self._row_sampling += new_sampling
        if any(params != self._one_sampling for params in new_sampling):
            self._one_sampling = None  # rows with settings of their own from now on
        # Drafters hold back every row's end tokens before its minimum: a few more than a row's own
        # costs some drafts, never exactness (the target's mask below is each row's own).
        self._end_ids = self._end_ids.union(*new_end_ids)
        self.drafter.eos_token_ids = self._end_ids
        stats.accepted_per_round += [[] for _ in prompts]
        stats.finish_reasons += [""] * len(prompts)
        if logprobs is not None:
            logprobs.add_rows(len(prompts))
        return PendingJoin(list(range(first, first + len(prompts))), prompts, prefill)

    def _advance_joins(self, pending: list[PendingJoin], whole: bool) -> list[int]:
        """One chunk (join_prefill_chunk tokens per row) of the first pending join's prefill, or
        every pending prefill whole (no chunk size, or no row running that would wait); the joins
        whose prefill is done enter the batch, first come first (the order of their numbers, which
        the drafters count too). Returns the rows that entered."""
        if whole or self.join_prefill_chunk is None:
            for join in pending:
                join.prefill.step()
        else:
            pending[0].prefill.step(self.join_prefill_chunk)
        entered = []
        while pending and pending[0].prefill.finished:
            join = pending.pop(0)
            hidden = join.prefill.finish()
            self.target.add_rows(join.prefill.lm)
            self.drafter.add_rows([list(p) for p in join.prompts],
                                  hidden if self.drafter.needs.hidden_state_layers else [{} for _ in join.prompts])
            entered += join.rows
        return entered

    @staticmethod
    def _row_limits(max_new_tokens, rows: int) -> list[int]:
        """max_new_tokens as one limit per row: a number for all, or a list of one per row."""
        limits = [max_new_tokens] * rows if not isinstance(max_new_tokens, (list, tuple)) else list(max_new_tokens)
        if len(limits) != rows:
            raise ValueError(f"max_new_tokens has {len(limits)} values for {rows} rows: give one number, "
                             "or one per row")
        bad = [m for m in limits if isinstance(m, bool) or not isinstance(m, int) or m < 1]
        if bad:
            raise ValueError(f"max_new_tokens must be >= 1 (a whole number), got {bad[0]!r}")
        return limits

    def _prefill(self, prompts: list[list[int]], layers, lm: CachedLM | None = None) -> list[dict[int, torch.Tensor]]:
        """Cache every prompt but its last token in `lm` (default: the target's cache, emptied);
        per row, the requested layers' states there (verifier/prefill.py)."""
        prefill = Prefill(lm if lm is not None else self.target, prompts, layers, self.device)
        prefill.step()
        return prefill.finish()

    def _verify(self, roots: torch.Tensor, trees: list[DraftTree], sampling: SamplingParams | RowSampling, coin,
                contexts: list[list[int]], outputs: list[list[int]], rows: list[int]):
        """One target pass over every row's root + tree and the verdict. Plain rounds and greedy
        chains take shorter paths to the same verdict (no packing, no tree walk). sampling: the
        rows' warpers (one setting, or each row's own); contexts: each row's committed tokens, the
        root included; outputs: the generated ones (for penalties); rows: each one's original row."""
        layers = self.drafter.needs.hidden_state_layers
        if all(t.size == 0 for t in trees):  # `none`, adaptive's zero-depth rounds, nothing proposed
            block = TreeBlock.column(roots.to(self.device))
            logits, hidden, for_logprobs = self._target_pass(block, layers, contexts, outputs, rows)
            verdict = verify_plain(logits[:, 0], sampling, coin)  # the draws verify_sampled makes
        elif sampling.greedy and all(t.is_chain() for t in trees):  # ngram, draft_model, mtp
            block = verification_block(roots, trees, self.device, chains=True)
            logits, hidden, for_logprobs = self._target_pass(block, layers, contexts, outputs, rows)
            verdict = verify_greedy_chains(logits.argmax(-1), block.tokens[:, 1:], block.valid[:, 1:])
        else:
            block = verification_block(roots, trees, self.device)
            logits, hidden, for_logprobs = self._target_pass(block, layers, contexts, outputs, rows)
            drafts = pack_drafts(trees, self.vocab_size, self.device)
            if sampling.greedy:
                verdict = verify_greedy(logits.argmax(-1), drafts)
            elif sampling.lossy:  # opted in: Medusa's typical acceptance, not exact
                verdict = verify_typical(processed_probs(logits, sampling), drafts, coin,
                                         sampling.lossy_typical_acceptance)
            else:
                verdict = verify_sampled(processed_probs(logits, sampling), drafts, coin)
        top = self._top_tokens(logits, block, trees) if self.drafter.needs.top_tokens else []
        return verdict, hidden, block.tokens.shape[1], for_logprobs, top

    def _top_tokens(self, logits: torch.Tensor, block: TreeBlock, trees: list[DraftTree]):
        """RoundFeedback.target_top: per row, the block's tokens (root, then the tree's nodes),
        the target's most likely next tokens after each and their probabilities (softmax of the
        logits, at temperature 1). One topk for the whole batch."""
        k = min(self.drafter.needs.top_tokens, logits.shape[-1])
        logits = logits.float()  # a bfloat16 target's too: the probabilities are kept in float32
        values, top = logits.topk(k, dim=-1)
        probs = (values - logits.logsumexp(-1, keepdim=True)).exp().nan_to_num(0.0)  # a row all -inf: 0
        n = [tree.size + 1 for tree in trees]
        return [(block.tokens[i, :m], top[i, :m], probs[i, :m]) for i, m in enumerate(n)]

    def _target_pass(self, block: TreeBlock, layers, contexts: list[list[int]], outputs: list[list[int]],
                     rows: list[int]):
        """The target's logits and states over a block; each row's logit_bias added; under
        penalties and bans, the logits as penalised and banned for each position's own context
        (committed tokens + its ancestors in the block), by each row's own settings; before
        min_new_tokens, EOS at the positions whose next token comes too early. Third: the logits
        logprobs are read from (else None): as the target gave them ("raw"), or as returned
        ("processed")."""
        logits, hidden = self.target.forward(block, layers)  # fresh: penalised in place
        minimums = [self._minimums[r] for r in rows] if self._end_ids else []
        holds_eos = any(least > len(out) for least, out in zip(minimums, outputs))  # some row's EOS is masked
        rows_sampling = self._sampling_of(rows)
        repetition, presence, frequency = row_penalties(rows_sampling, self.device)
        bias = row_biases(rows_sampling, logits.device)
        penalizes_counts = presence is not None or frequency is not None
        bans = row_bans(rows_sampling)
        grammars = row_grammars(rows_sampling, len(rows))
        changes = any(bans) or grammars is not None or holds_eos or bias is not None or repetition is not None or penalizes_counts
        raw = (logits.clone() if changes else logits) if self._logprobs_mode == "raw" else None
        if bias is not None:  # before the penalties, as Hugging Face adds its sequence_bias
            logits = bias.add_(logits)
        # A table no row of this round needs is dropped: it would miss the rows that join and
        # leave meanwhile, so it is rebuilt from whole rows when a row needs it again.
        self._context_seen = (self._context_seen or ContextTokens(self.vocab_size, self.device)
                              if repetition is not None else None)
        self._generated_counts = (self._generated_counts or ContextTokens(self.vocab_size, self.device, counts=True)
                                  if penalizes_counts else None)
        if repetition is not None:
            logits = penalize_block_repeats_(logits, block.tokens, block.ancestors, self._context_seen.update(contexts),
                                             repetition)
        if penalizes_counts:
            logits = penalize_block_counts_(logits, block.tokens, block.ancestors,
                                            self._generated_counts.update(outputs), presence, frequency)
        if any(bans):
            logits = self._bans.ban_(logits, block, rows, contexts, bans)
        if grammars is not None:
            self._row_grammars = self._row_grammars or RowGrammars(self.grammars)
            logits = self._row_grammars.mask_(logits, block, rows, outputs, grammars,
                                              [self._row_end_ids[r] for r in rows])
        if holds_eos:
            produced = torch.tensor([len(o) for o in outputs], device=logits.device)
            least = torch.tensor(minimums, device=logits.device)
            # A position at depth d predicts new token number produced + d + 1 (the root: d = 0).
            too_early = (produced[:, None] + block.depth.to(logits.device) < least[:, None])[..., None]
            ends = sorted(self._end_ids)
            if any(self._row_end_ids[r] != self._end_ids for r in rows):  # rows with their own stop ids
                own = torch.tensor([[t in self._row_end_ids[r] for t in ends] for r in rows], device=logits.device)
                too_early = too_early & own[:, None, :]  # a row's EOS mask holds back its own end tokens only
            eos = torch.tensor(ends, device=logits.device)
            logits[..., eos] = logits[..., eos].masked_fill(too_early, float("-inf"))
        return logits, hidden, logits if self._logprobs_mode == "processed" else raw

    def _draft_grammar(self, active: list[int], round_sampling, outputs: list[list[int]]) -> DraftGrammar | None:
        """What the active rows' grammars allow their drafts this round (Drafter.grammar); None
        when no row has one, or when drafts are left free (draft_within_grammar False)."""
        specs = row_grammars(round_sampling, len(active))
        if specs is None or not self.draft_within_grammar:
            return None
        self._row_grammars = self._row_grammars or RowGrammars(self.grammars)
        return self._row_grammars.drafts(active, [outputs[r] for r in active], specs,
                                         [self._row_end_ids[r] for r in active])

    def _clip(self, tokens: list[int], produced: int, context_len: int, max_new_tokens: int, end_ids: frozenset[int]):
        """Cut a round's tokens at EOS or one of the row's stop tokens (kept), max_new_tokens and
        the context; say why a row ends."""
        for j, t in enumerate(tokens):
            if t in end_ids:
                return tokens[: j + 1], "eos" if t in self.eos_token_ids else "stop"
        room_new = max_new_tokens - produced
        room_ctx = self.max_context - context_len
        if len(tokens) >= room_new and room_new <= room_ctx:
            return tokens[:room_new], "length"
        if len(tokens) >= room_ctx:
            return tokens[:room_ctx], "context"
        return tokens, ""

    def _kept_hidden(self, hidden: dict, keep_slots: list[list[int]]) -> list[dict[int, torch.Tensor]]:
        """Per row, each requested layer's states at the kept slots. One gather per layer for the
        whole batch, then per-row views: indexing every row and layer with its own list of slots
        took 150 us a round at batch 8 (EAGLE-3's three layers), this takes 46."""
        if not hidden:
            return []
        width = max(len(slots) for slots in keep_slots)
        if width == 0:
            return [{} for _ in keep_slots]
        if all(slots == list(range(width)) for slots in keep_slots):  # plain rounds, full chains
            kept = {k: h[:, :width] for k, h in hidden.items()}
        else:
            index = torch.tensor([slots + [0] * (width - len(slots)) for slots in keep_slots], device=self.device)
            kept = {k: h.gather(1, index[:, :, None].expand(-1, -1, h.shape[-1])) for k, h in hidden.items()}
        return [{k: h[i, : len(slots)] for k, h in kept.items()} for i, slots in enumerate(keep_slots)]
