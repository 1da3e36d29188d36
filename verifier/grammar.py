"""The grammars of structured output (verifier/structured.py) compiled for the target's tokenizer,
and each row's matcher masking a verification block: at every valid node, the tokens the grammar
does not allow after the node's own sequence (the row's output, then the node's path) get -inf.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .block_penalties import writable
from .ngram_ban import node_paths
from .structured import StructuredOutput
from .token_masks import TokenMasks
from .tree import TreeBlock


class GrammarCompiler:
    """Compiles grammars for one tokenizer: llguidance's view of it is built once, when the first
    grammar needs it (50 ms for the bundled 8192-token vocabulary; llguidance puts large ones at
    about 1 s)."""

    # Compiled grammars kept, the least recently used dropped first: a row's matcher is a copy of
    # its grammar's (5 us against 0.4-1 ms to compile a small JSON schema or regex for the
    # bundled vocabulary), and a server sees the same few schemas request after request.
    KEPT_GRAMMARS = 64

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the target's logits width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # spec -> an unused matcher
        self._lock = threading.Lock()  # requests check grammars while the batch's rows take matchers

    def tokenizer(self):
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError:
                raise ValueError("structured_output needs llguidance, which draftsman depends on and this "
                                 "environment lacks: pip install llguidance") from None
            n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
            try:
                built = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab,
                                                     eos_token=self.eos_token_ids or None)
            except ValueError as e:
                raise ValueError(f"structured_output needs a fast (tokenizers) tokenizer: {e}") from None
            self._tokenizer = _with_added_text_tokens(built, self.hf_tokenizer, n_vocab)
        return self._tokenizer

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher for `spec`, at its grammar's start: a copy of the one compiled for it
        (never advanced itself). A grammar that does not compile is refused with llguidance's reason."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.KEPT_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def _compile(self, spec: StructuredOutput):
        from llguidance import LLMatcher
        try:
            matcher = LLMatcher(self.tokenizer(), spec.grammar(), log_level=0)
        except ValueError as e:  # JSON that is no object, for instance
            raise ValueError(f"structured_output {spec.describe()!r} does not compile: {str(e).strip()}") from None
        if matcher.is_error():
            raise ValueError(f"structured_output {spec.describe()!r} does not compile: {matcher.get_error().strip()}")
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Refuse a grammar that does not compile (compiled once, and kept for the rows that use it)."""
        self.matcher(spec)


def _with_added_text_tokens(built, hf_tokenizer, n_vocab: int):
    """llguidance's tokenizer `built`, with the added tokens the HF tokenizer keeps as text (special
    false: Qwen's <think>, <tool_call>) made text tokens; `built` itself when there are none.

    llguidance makes every added token spelled <...> special, so a grammar could not write one, yet
    its mask allows it where the grammar's text is that token's: the matcher then refuses the
    token the mask let through. As text tokens, the grammar writes and reads them as the text
    they decode to; special tokens (EOS, turn markers) stay special."""
    from llguidance import LLTokenizer, TokenizerWrapper
    added = hf_tokenizer.added_tokens_decoder  # id -> AddedToken
    text_tokens = {i: token.content for i, token in added.items()
                   if not token.special and i < n_vocab and built.is_special_token(i)}
    if not text_tokens:
        return built
    # Every other token as llguidance built it (the special ones' bytes without its marker,
    # which LLTokenizer puts back for special_ids), the logits' padding past the vocabulary too.
    tokens = [text_tokens[i].encode() if i in text_tokens else built.decode_bytes([i]) for i in range(n_vocab)]
    special_ids = [i for i in range(n_vocab) if i not in text_tokens and built.is_special_token(i)]
    wrapped = TokenizerWrapper(_Vocabulary(hf_tokenizer, tokens, special_ids, built.eos_token))
    return LLTokenizer(wrapped, n_vocab=n_vocab, eos_token=built.eos_tokens)  # the end tokens llguidance chose


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each token's bytes, which are
    special, and how text encodes (as the HF tokenizer encodes it, as llguidance's own does)."""

    def __init__(self, hf_tokenizer, tokens: list[bytes], special_token_ids: list[int], eos_token_id: int):
        self.hf_tokenizer, self.tokens, self.special_token_ids = hf_tokenizer, tokens, special_token_ids
        self.eos_token_id, self.bos_token_id = eos_token_id, hf_tokenizer.bos_token_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper then passes text, never cut UTF-8
            raise TypeError("text only")
        return self.hf_tokenizer.encode(text, add_special_tokens=False)


class RowGrammars:
    """Each row's matcher in one generation, made when the row first needs it and advanced by
    the tokens the row commits; the masks of a verification block's nodes, and of a round's
    drafts (drafts())."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[int, object] = {}  # original row -> its matcher
        self._consumed: dict[int, int] = {}  # original row -> output tokens the matcher has taken
        self._starts: dict[int, int | None] = {}  # original row -> where its grammar begins in its output

    def mask_(self, logits: torch.Tensor, block: TreeBlock, rows: list[int], outputs: list[list[int]],
              specs: list[StructuredOutput | None], end_ids: list[frozenset[int]]) -> torch.Tensor:
        """Set to -inf, in (B, T, V) block logits (in place; in a float32 copy when lower), every
        token the row's grammar does not allow at each valid node, and return them. rows: each block
        row's original row; outputs: each row's new tokens so far; specs: each row's grammar (None:
        none); end_ids: each row's end tokens, allowed where its grammar may end. A node whose path
        the grammar forbids is never reached, and one below an end token never emitted: both are
        left as they are."""
        which = [b for b, spec in enumerate(specs) if spec is not None]
        if not which:
            return logits
        asks = []  # (block row, position) of each node, its row's walk, its path
        for b, row, output, nodes in node_paths(block, rows, outputs, which):
            walk = self._walk(row, specs[b], output, end_ids[b])
            asks += [((b, j), walk, path) for j, path in nodes]
        masked, masks = self._allowed(asks)
        if not masked:
            return logits
        logits = writable(logits).contiguous()
        positions = logits.shape[1]
        masks.apply_(logits.view(-1, logits.shape[-1]), [b * positions + j for b, j in masked])
        return logits

    def drafts(self, rows: list[int], outputs: list[list[int]], specs: list[StructuredOutput | None],
               end_ids: list[frozenset[int]]) -> "DraftGrammar":
        """What each row's grammar lets this round's drafts be (arguments as in mask_, one per
        row of the coming propose)."""
        walks = [None if spec is None else self._walk(row, spec, output, ends)
                 for row, output, spec, ends in zip(rows, outputs, specs, end_ids)]
        return DraftGrammar(self, walks)

    def _walk(self, row: int, spec: StructuredOutput, output: list[int], end_ids: frozenset[int]) -> "_RowWalk":
        matcher, started = self._advanced(row, spec, output)
        marker = spec.after
        tail = () if started else tuple(output[max(0, len(output) - (len(marker) - 1)):])  # a marker may span both
        return _RowWalk(matcher, started, tail, marker, end_ids)

    def _allowed(self, asks: list) -> tuple[list, TokenMasks | None]:
        """(the keys of the asks the grammar holds, their masks: what each allows, packed; None
        when none is held). asks: (key, walk, path) with each walk's asks together, best in tree
        order (each path shares the most with the one before); an ask whose node the grammar
        does not hold (not begun, forbidden path, below an end token) is left out."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
        bitmask = allocate_token_bitmask(max(1, len(asks)), self.compiler.tokenizer().vocab_size)
        masked, walks = [], []  # walks: the walk of each masked ask
        last = None
        for key, walk, path in asks:
            if walk is not last and last is not None:
                last.leave()
            last = walk
            if walk.reach(path):
                fill_next_token_bitmask(walk.matcher, bitmask, len(masked))
                masked.append(key)
                walks.append(walk)
        if last is not None:
            last.leave()
        if not masked:
            return masked, None
        masks = TokenMasks(bitmask[: len(masked)])
        eos = self.compiler.eos_token_ids
        may_end = masks.allows(eos).any(-1) if eos else torch.zeros(len(masked), dtype=torch.bool)
        ends = {}  # a row's stop tokens end it where its grammar may end: each walk's masks that may
        for i, walk in enumerate(walks):
            ends.setdefault(id(walk), (walk.end_ids, []))[1].append(i)
        for end_ids, at in ends.values():
            which = torch.zeros(len(masked), dtype=torch.bool)
            which[at] = may_end[at]
            masks.allow_(which, sorted(end_ids))
        return masked, masks

    def _advanced(self, row: int, spec: StructuredOutput, output: list[int]):
        """(the row's matcher, fed the output tokens it has not taken yet; whether the grammar has
        begun in the committed output: always, unless it waits for a marker not yet there)."""
        if row not in self._matchers:
            self._matchers[row], self._consumed[row] = self.compiler.matcher(spec), 0
            self._starts[row] = None if spec.after else 0
        matcher, start = self._matchers[row], self._starts[row]
        if start is None:
            held = _after(output, spec.after)
            if held is None:
                return matcher, False
            start = self._starts[row] = len(output) - len(held)
        done = start + self._consumed[row]
        if done < len(output):
            if not matcher.consume_tokens(output[done:]):  # each was drawn under this grammar's mask
                raise RuntimeError(f"row {row}'s output left its grammar: {matcher.get_error()}")
            self._consumed[row] = len(output) - start
        return matcher, True


class _RowWalk:
    """One row's matcher taken along paths below its committed output: each path's tokens beyond
    what it shares with the path before are consumed, the rest rolled back; leave() returns the
    matcher to the committed output."""

    def __init__(self, matcher, started: bool, tail: tuple[int, ...], marker: tuple[int, ...],
                 end_ids: frozenset[int]):
        self.matcher, self.started, self.tail, self.marker, self.end_ids = matcher, started, tail, marker, end_ids
        self.taken: list[int] = []  # path tokens the matcher holds beyond the committed output

    def held(self, path: list[int]) -> list[int] | None:
        """The part of `path` the grammar holds: all of it once the grammar has begun, else what
        follows the marker; None where it has not begun."""
        return path if self.started else _after(list(self.tail) + path, self.marker)

    def reach(self, path: list[int]) -> bool:
        """Move the matcher to the node after `path`; False (matcher anywhere) where the grammar
        does not hold that node: not begun, a forbidden token on the path, or below an end."""
        if not self.end_ids.isdisjoint(path):  # below the row's end: never emitted
            return False
        path = self.held(path)
        if path is None:
            return False
        taken, matcher = self.taken, self.matcher
        same = 0
        while same < min(len(taken), len(path)) and taken[same] == path[same]:
            same += 1
        if len(taken) > same:
            matcher.rollback(len(taken) - same)
            del taken[same:]
        fits = matcher.validate_tokens(path[same:])  # tokens the grammar takes, state unchanged
        matcher.consume_tokens(path[same:same + fits])
        taken += path[same:same + fits]
        return len(taken) == len(path)

    def leave(self) -> None:
        self.matcher.rollback(len(self.taken))
        self.taken = []


class DraftGrammar:
    """A round's grammars as its drafters see them (the engine sets one on the drafter before each
    propose, under structured output): what each row's grammar allows after a path of drafts,
    so a drafter drafts only tokens the verifier can accept (drafters/path_bans.py). Drafts
    only: a sampled draft's q is the distribution it was drawn from, masked or not, so the
    verifier stays exact either way."""

    def __init__(self, grammars: RowGrammars, walks: list[_RowWalk | None]):
        self._grammars, self.walks = grammars, walks
        self.vocab_size = grammars.compiler.vocab_size  # the target's token ids: [0, vocab_size)

    def masks(self, asks: list[tuple[object, int, list[int]]]) -> tuple[list, TokenMasks | None]:
        """(the keys of the asks a grammar holds, what each allows over token ids, packed (None
        where none is held)). asks: (key, row, path of drafts below the root), each row's together."""
        return self._grammars._allowed([(key, self.walks[row], path) for key, row, path in asks
                                        if self.walks[row] is not None])

    def allowed(self, asks: list[tuple[object, int, list[int]]], width: int) -> tuple[list, torch.Tensor]:
        """masks(), unpacked: bool (n, width) over token ids."""
        keys, masks = self.masks(asks)
        return keys, torch.zeros(0, width, dtype=torch.bool) if masks is None else masks.allowed(width)

    def forced(self, row: int) -> list[int]:
        """The tokens the row's grammar forces next, as llguidance spells them (its fast-forward
        tokens: a JSON schema's fixed keys, for instance); [] with no grammar, before it begins,
        or where it leaves a choice. The target may spell the same text otherwise, so a draft of
        them is likely, not certain, to be accepted."""
        walk = self.walks[row]
        if walk is None or not walk.started:
            return []
        return list(walk.matcher.compute_ff_tokens())

    def fits(self, row: int, continuation: list[int]) -> int:
        """How many leading tokens of a copied continuation the row's grammar lets it draft, up
        to its first end token (what follows one is never emitted)."""
        walk = self.walks[row]
        if walk is None:
            return len(continuation)
        n = next((j + 1 for j, token in enumerate(continuation) if token in walk.end_ids), len(continuation))
        held = walk.held(continuation[:n])
        if held is None:  # the grammar has not begun
            return n
        free = n - len(held)  # tokens before the marker
        fits = walk.matcher.validate_tokens(held)
        if fits < len(held) and held[fits] in walk.end_ids:  # a stop token, where the grammar may end
            walk.matcher.consume_tokens(held[:fits])
            ends_here = walk.matcher.is_accepting()
            walk.matcher.rollback(fits)
            fits += ends_here
        return free + fits


def _after(sequence: list[int], marker: tuple[int, ...]) -> list[int] | None:
    """The tokens after the first occurrence of `marker` in `sequence`, or None when it has none."""
    m = len(marker)
    for i in range(len(sequence) - m + 1):
        if tuple(sequence[i:i + m]) == marker:
            return sequence[i + m:]
    return None
