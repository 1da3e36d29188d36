"""The recurrent layers of a hybrid target (Qwen3-Next and Qwen3.5's Gated DeltaNet, Mamba-2 in
Nemotron-H / Bamba / Granite 4, LFM2's short convolutions): their state, kept per row.

An attention layer forgets a rejected draft by masking its slot; a recurrent layer has folded
every token it saw into one state, so it cannot. What it can do is remember: Hugging Face's
cache layers record the states a pass went through ("past recording", made for assisted
generation), and after the verdict each row takes the state it had after its kept tokens. That
asks two things of the caller: a row keeps a prefix of its block (its block is a chain, so the
tokens it keeps are the first n), and the states between are recorded, which costs a pass over
the block's last tokens one at a time. A prefill keeps all or nothing of each row's piece and
records none.

A draft model's cache also goes back: its drafts beyond the accepted ones are forgotten each
round. For that the states after each accept() are copied (snapshots), and rollback() returns
each row to the one at its new length (or to the empty state, at 0).

State layout, per layer and per state index (most layers have one): a conv state (B, C, K), the
last K inputs of its causal convolution, and, where the layer has one, a recurrent state (B, ...).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer


MAX_SNAPSHOTS = 64  # a draft model rolls back within a round: k + 1 snapshots are all it needs


class RecurrentStates:
    """The recurrent layers of one CachedLM's cache, the bookkeeping of one pending pass, and the
    snapshots a draft model's rollback returns to."""

    def __init__(self, layers: list[LinearAttentionLayer], scan_restarts: bool = False):
        """scan_restarts: the model's scan over several tokens starts from a zero state, not the
        cached one (Hugging Face's Mamba, Falcon Mamba and Jamba, their own TODO); a pass that
        continues a state then steps every token from it (recorded), which is right, only slower.
        Those steps update the cached state in place before the layer copies it as "the state
        before the pass", so the copy is taken here."""
        self.layers = layers
        self.scan_restarts = scan_restarts
        self._before: dict[tuple[int, int], torch.Tensor] = {}  # (layer, state index) -> state before the pass
        self._conv_before: list[dict[int, int]] = []  # per layer: columns of each conv state before the pass
        self._tokens = 0  # tokens per row in the pending pass (0: none pending)
        self.snapshots: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (lengths (B,), copied states)

    def _states(self) -> list[tuple[dict, int]]:
        """(table, index) of every state that exists, in a fixed order."""
        return [(states, i) for layer in self.layers for states, ready in _tables(layer) for i in states if ready[i]]

    def snapshot(self, lengths: torch.Tensor) -> None:
        """Copy the states, each row's at its length (after an accept())."""
        self.snapshots.append((lengths.clone(), [states[i].clone() for states, i in self._states()]))
        del self.snapshots[:-MAX_SNAPSHOTS]

    def restore(self, new_lengths: torch.Tensor, lengths: torch.Tensor) -> None:
        """Each row's states become those at new_lengths[b]: its current ones, the empty state (0),
        or the latest snapshot's at that length. Snapshots are dropped after (the rows moved)."""
        at = torch.stack([lengths for lengths, _ in self.snapshots]).tolist() if self.snapshots else []  # one sync
        pick = []  # per row: 0 its current states, 1 + j snapshot j, len(snapshots) + 1 the empty state
        for b, (new, now) in enumerate(zip(new_lengths.tolist(), lengths.tolist())):
            found = [j for j, row_lengths in enumerate(at) if row_lengths[b] == new]
            if new == now:
                pick.append(0)
            elif new == 0:
                pick.append(len(self.snapshots) + 1)
            elif found:
                pick.append(1 + found[-1])
            else:
                raise RuntimeError(f"row {b} cannot return to length {new} (it is at {now}): no state was "
                                   "kept there; a model with recurrent layers returns only to lengths it accepted at")
        if any(pick):
            for n, (states, i) in enumerate(self._states()):
                current = states[i]
                states[i] = _rows_from([current, *(copies[n] for _, copies in self.snapshots),
                                        torch.zeros_like(current)], pick)
        self.snapshots.clear()

    def before_forward(self, tokens: int, keep_all: bool) -> None:
        """Record the states of the next pass of `tokens` tokens per row. keep_all: every row will
        keep all or none of its tokens (a prefill), so no state between is needed."""
        assert self._tokens == 0, "forward() twice without accept(): a recurrent state cannot hold two passes"
        self._tokens = tokens
        self._conv_before = []
        continues = any(any(layer.has_previous_state.values()) for layer in self.layers)
        step_all = not keep_all or (self.scan_restarts and continues)
        self._before = {(n, i): layer.recurrent_states[i].clone() for n, layer in enumerate(self.layers)
                        for i in range(layer.number_of_states)
                        if self.scan_restarts and layer.is_recurrent_states_initialized[i]}
        for layer in self.layers:
            layer.record_past = True
            layer.recurrent_states_to_keep = tokens if step_all else 0
            layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}
            self._conv_before.append({i: layer.conv_states[i].shape[-1] if layer.has_previous_state[i] else 0
                                      for i in range(layer.number_of_states)})

    def keep(self, counts: torch.Tensor) -> None:
        """Row b keeps the first counts[b] tokens of the pending pass: its states become those after them."""
        T = self._tokens
        assert T > 0, "keep() without a pending forward()"
        kept, pick = counts.tolist(), None  # pick: the same for every layer, as all recorded alike
        for n, (layer, conv_before) in enumerate(zip(self.layers, self._conv_before)):
            for i in range(layer.number_of_states):
                if layer.is_conv_states_initialized[i]:
                    layer.conv_states[i] = _conv_window(layer.conv_states[i], conv_before[i], counts,
                                                        layer.conv_kernel_size[i])
                if layer.is_recurrent_states_initialized[i]:
                    history = layer.recurrent_states_history[i]
                    if (n, i) in self._before:  # the layer's own copy was taken after its in-place steps
                        history = [self._before[n, i], *history[1:]]
                    pick = pick or _recorded_index(len(history), kept, T)
                    layer.recurrent_states[i] = _rows_from([*history, layer.recurrent_states[i]], pick)
                layer.recurrent_states_history[i] = []
        self._tokens, self._before = 0, {}

    def select_rows(self, ix: torch.Tensor) -> None:
        # The snapshots follow the rows: a draft model's first feed runs a repeated prompt once,
        # then copies its row, and each copy must still return to the prompt's length.
        self.snapshots = [(lengths[ix.to(lengths.device)], [copy[ix] for copy in copies])
                          for lengths, copies in self.snapshots]
        for layer in self.layers:
            for states, ready in _tables(layer):
                for i in states:
                    if ready[i]:
                        states[i] = states[i][ix]

    def add_rows(self, other: "RecurrentStates | None", mine: int, theirs: int) -> None:
        """Rows join after the current `mine` ones: `other`'s (a cache prefilled apart), or
        `theirs` rows that have seen nothing (zero states, as a sequence starts) when other is None."""
        assert self._tokens == 0 and (other is None or other._tokens == 0), "add_rows() with a pass pending"
        self.snapshots.clear()
        for n, layer in enumerate(self.layers):
            their_layer = None if other is None else other.layers[n]
            theirs_tables = _tables(their_layer) if their_layer is not None else [({}, {})] * 2
            for (states, ready), (their_states, their_ready) in zip(_tables(layer), theirs_tables):
                for i in states:
                    m = states[i] if ready[i] else None
                    t = their_states[i] if their_ready.get(i) else None
                    if m is None and t is None:
                        continue
                    like = m if m is not None else t
                    states[i] = torch.cat([m if m is not None else like.new_zeros(mine, *like.shape[1:]),
                                           t if t is not None else like.new_zeros(theirs, *like.shape[1:])])
                    ready[i] = layer.has_previous_state[i] = True
            if their_layer is not None:  # a layer that has not run yet learns its kernel width from theirs
                for i, width in their_layer.conv_kernel_size.items():
                    if layer.conv_kernel_size[i] is None:
                        layer.conv_kernel_size[i] = width


def _tables(layer: LinearAttentionLayer):
    return ((layer.conv_states, layer.is_conv_states_initialized),
            (layer.recurrent_states, layer.is_recurrent_states_initialized))


def _conv_window(full: torch.Tensor, before: int, counts: torch.Tensor, K: int) -> torch.Tensor:
    """The last K conv inputs of each row after its kept tokens. full (B, ..., before + T): the
    recorded inputs, the `before` columns of the old state then the pass's T; row b's window ends
    after column before + counts[b]. K zero columns in front stand for a sequence's start."""
    padded = torch.nn.functional.pad(full, (K, 0))
    index = (before + counts).to(full.device)[:, None] + torch.arange(K, device=full.device)  # (B, K), padded
    index = index.view(full.shape[0], *([1] * (full.dim() - 2)), K).expand(*full.shape[:-1], K)
    return padded.gather(-1, index).contiguous()


def _recorded_index(h: int, kept: list[int], T: int) -> list[int]:
    """Per row, which of a layer's recorded states follows its first kept[b] tokens of a T-token
    pass: the layer recorded history = [the state before the pass, then the states after its last
    h - 1 tokens but the final one] (h states), and index h is the final one."""
    assert h >= 1, "the pass was not recorded (before_forward() not called)"
    after = [0] + [T - h + j for j in range(1, h)] + [T]  # index j: the state after this many tokens
    if not set(kept) <= set(after):
        raise RuntimeError(f"rows kept {kept} of {T} tokens, but the states after only {after} tokens were recorded")
    return [h if n == T else after.index(n) for n in kept]


def _rows_from(candidates: list[torch.Tensor], pick: list[int]) -> torch.Tensor:
    """Row b of candidates[pick[b]], for each row: one indexed copy per candidate used (none when
    every row takes the same one), not a stack of all of them."""
    if len(set(pick)) == 1:
        return candidates[pick[0]]
    out = torch.empty_like(candidates[0])
    for j in set(pick):
        rows = torch.tensor([b for b, p in enumerate(pick) if p == j], device=out.device)
        out[rows] = candidates[j][rows]
    return out
