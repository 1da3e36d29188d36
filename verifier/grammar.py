"""The grammars of structured output (verifier/structured.py) compiled for the target's tokenizer,
and each row's matcher masking a verification block: at every valid node, the tokens the grammar
does not allow after the node's own sequence (the row's output, then the node's path) get -inf.
"""
from __future__ import annotations

import torch

from .block_penalties import writable
from .ngram_ban import node_paths
from .structured import StructuredOutput
from .tree import TreeBlock


class GrammarCompiler:
    """Compiles grammars for one tokenizer: llguidance's view of it is built once, when the first
    grammar needs it (50 ms for the bundled 8192-token vocabulary; llguidance puts large ones at
    about 1 s)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the target's logits width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._checked: set[StructuredOutput] = set()

    def tokenizer(self):
        if self._tokenizer is None:
            try:
                import llguidance.hf
            except ImportError:
                raise ValueError("structured_output needs llguidance, which draftsman depends on and this "
                                 "environment lacks: pip install llguidance") from None
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=max(self.vocab_size, len(self.hf_tokenizer)),
                    eos_token=self.eos_token_ids or None)
            except ValueError as e:
                raise ValueError(f"structured_output needs a fast (tokenizers) tokenizer: {e}") from None
        return self._tokenizer

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher for `spec`; a grammar that does not compile is refused with llguidance's reason."""
        from llguidance import LLMatcher
        try:
            matcher = LLMatcher(self.tokenizer(), spec.grammar(), log_level=0)
        except ValueError as e:  # JSON that is no object, for instance
            raise ValueError(f"structured_output {spec.describe()!r} does not compile: {str(e).strip()}") from None
        if matcher.is_error():
            raise ValueError(f"structured_output {spec.describe()!r} does not compile: {matcher.get_error().strip()}")
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Refuse a grammar that does not compile (each one compiled once)."""
        if spec not in self._checked:
            self.matcher(spec)
            self._checked.add(spec)


class RowGrammars:
    """Each row's matcher in one generation, made when the row first needs it and advanced by
    the tokens the row commits, and the masks of a verification block's nodes."""

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
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
        width = logits.shape[-1]
        masked: list[tuple[int, int]] = []  # (block row, position) of bitmask row i
        nodes_at_most = sum(int(block.valid[b].sum()) for b in which)
        bitmask = allocate_token_bitmask(nodes_at_most, self.compiler.tokenizer().vocab_size)
        for b, row, output, nodes in node_paths(block, rows, outputs, which):
            marker = specs[b].after
            matcher, started = self._advanced(row, specs[b], output)
            tail = [] if started else output[max(0, len(output) - (len(marker) - 1)):]  # a marker may span both
            taken: list[int] = []  # path tokens the matcher holds beyond the committed output
            for j, full_path in nodes:
                if not end_ids[b].isdisjoint(full_path):  # below the row's end: never emitted
                    continue
                path = full_path if started else _after(tail + full_path, marker)
                if path is None:  # the grammar has not begun at this node: left free
                    continue
                same = 0
                while same < min(len(taken), len(path)) and taken[same] == path[same]:
                    same += 1
                if len(taken) > same:
                    matcher.rollback(len(taken) - same)
                    del taken[same:]
                fits = matcher.validate_tokens(path[same:])  # tokens the grammar takes, state unchanged
                matcher.consume_tokens(path[same:same + fits])
                taken += path[same:same + fits]
                if len(taken) == len(path):  # else a token on the path is forbidden: never reached
                    fill_next_token_bitmask(matcher, bitmask, len(masked))
                    masked.append((b, j))
            matcher.rollback(len(taken))
        if not masked:
            return logits
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[: len(masked), :, None] >> bits) & 1).bool().flatten(1)[:, :width]
        eos = self.compiler.eos_token_ids
        may_end = allowed[:, eos].any(-1) if eos else torch.zeros(len(masked), dtype=torch.bool)
        at_b = torch.tensor([b for b, _ in masked])
        ends = torch.zeros(len(specs), width, dtype=torch.bool)  # each block row's end tokens
        for b in which:
            ends[b, [t for t in end_ids[b] if t < width]] = True
        allowed |= ends[at_b] & may_end[:, None]  # a row's stop tokens end it where its grammar may end
        logits = writable(logits)
        at_b, at_j = at_b.to(logits.device), torch.tensor([j for _, j in masked], device=logits.device)
        logits[at_b, at_j] = logits[at_b, at_j].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

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


def _after(sequence: list[int], marker: tuple[int, ...]) -> list[int] | None:
    """The tokens after the first occurrence of `marker` in `sequence`, or None when it has none."""
    m = len(marker)
    for i in range(len(sequence) - m + 1):
        if tuple(sequence[i:i + m]) == marker:
            return sequence[i + m:]
    return None
