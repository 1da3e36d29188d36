"""A Hugging Face causal LM with a KV cache for a ragged batch of tree-shaped inputs.

The cache holds S slots per row. `slot_pos` (B, S) gives each slot's position in its row, or -1
for a hole (padding, a rejected draft, a rolled-back token); holes are masked out of attention, so
rows of different lengths share one cache tensor. Positions are passed explicitly, which is what
lets a slot's place in the tensor differ from its position in the text.

    forward(block)  run a TreeBlock on top of the cache; its slots are pending
    accept(keep)    keep these block nodes (a root-first path per row), drop the rest
    rollback(lens)  forget every slot at position >= lens[b]
    select_rows(ix) drop finished rows
    add_rows(other) rows join the batch (continuous batching): another cache's, or empty ones

Sliding-window layers (Mistral, Gemma 2 / 3, Qwen2 with use_sliding_window, Phi-3) keep every
slot, as full-attention ones do: a slot is dropped only when its draft is rejected, which a
window that evicts by count cannot know. Their window is in the mask instead: a node sees a key
at position k only if k > its own position - sliding_window, as Hugging Face masks it. Llama 4's
chunked layers likewise: a node at position p sees keys of its own chunk, k // chunk == p // chunk
(its NoPE layers' query temperature: verifier/query_temperature.py). With trim_windows (the
engine's target cache), those layers then let go of the leading slots that no later token can see
(`local_start`: their storage starts at that slot), so their memory and attention stay about a
window long, as in Hugging Face's own window cache.

Hybrid targets (Qwen3-Next, Qwen3.5, Nemotron-H, LFM2, ...) also have recurrent layers, whose
state cannot skip a hole: verifier/recurrent_state.py keeps it per row. They read a chain per row;
a tree, as a row per branch (verifier/branches.py).
"""
from __future__ import annotations

import contextlib

import torch
import transformers
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from .direct_forward import DirectForward
from .query_temperature import QueryTemperature
from . import hf_compat
from .hf_compat import PER_ROW_LOGITS_TO_KEEP, cache_kwarg
from .branches import Branches
from .recurrent_state import RecurrentStates
from .tree import TreeBlock


class SlotLayer(DynamicLayer):
    """A DynamicLayer that writes new entries into preallocated storage (doubling when full)
    instead of concatenating the whole cache every step, so cropping is just a shorter length
    (as in gpt-fast). `keys` / `values` are views of the used slots; assigning a tensor to them
    replaces the storage."""

    def __init__(self):
        self._k = self._v = None
        self._n = 0
        super().__init__()

    keys = property(lambda self: None if self._k is None else self._k[:, :, : self._n])
    values = property(lambda self: None if self._v is None else self._v[:, :, : self._n])

    @keys.setter
    def keys(self, tensor):
        self._k = tensor
        self._n = 0 if tensor is None else tensor.shape[2]

    @values.setter
    def values(self, tensor):
        self._v = tensor
        self._n = 0 if tensor is None else tensor.shape[2]

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self._k, self._v = key_states[:, :, :0], value_states[:, :, :0]
        self._n = 0
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T = self._n, key_states.shape[2]
        if n + T > self._k.shape[2]:
            capacity = max(256, 2 * (n + T))
            grown_k = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[3])
            grown_v = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[3])
            grown_k[:, :, :n], grown_v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
            self._k, self._v = grown_k, grown_v
        self._k[:, :, n : n + T] = key_states
        self._v[:, :, n : n + T] = value_states
        self._n = n + T
        return self.keys, self.values

    def truncate(self, num_slots: int) -> None:
        self._n = min(self._n, num_slots)


class CachedLM:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None, direct: bool = False,
                 snapshots: bool = False, trim_windows: bool = False, trim_margin: int = 0,
                 own_masks: bool = False):
        """dtype: what the attention computes in, for the 4D mask (default: the model's dtype; a
        head drafting in bfloat16 inside a body whose shared embeddings stay float32 says so).
        direct: call the model's layers without Hugging Face's wrappers where its family allows
        (verifier/direct_forward.py); for drafters only, the target runs its own forward.
        snapshots: copy a hybrid model's recurrent states after each accept(), so that rollback()
        can return to the lengths accepted at (a draft model's cache); without, a drafter's cache
        (direct) refuses a hybrid model.
        trim_windows: sliding and chunked layers drop the slots no later token sees (module
        docstring); such a cache cannot take rows from a trimmed one.
        trim_margin: with trim_windows, how far rollback() may go back (a draft model's drafts of a
        round): those layers keep the keys the tokens this many positions back would see, and a
        rollback goes back at most so far (or to 0, a row fed afresh).
        own_masks: always pass draftsman's mask, never let Hugging Face build one: it sizes its masks
        from the cache's first (or first sliding) layer, which a view of part of a model's layers
        (layer_skip) may never write."""
        self.model = model
        self.own_masks = own_masks
        self.device = next(model.parameters()).device
        self.dtype = dtype or model.dtype
        self.cache_kwarg = cache_kwarg(model)  # 'cache' or 'past_key_values', by transformers release
        # Its windowed layers' kind ("sliding_attention", "chunked_attention"; None: it has none) and
        # window or chunk, and whether its forward takes a mask per layer kind or one for all.
        self.local_kind, self.local_size, self._masks_by_kind = _local_attention(model.config)
        self._temperature = QueryTemperature.for_model(model)  # Llama 4: None elsewhere
        self.trim_windows = trim_windows and self.local_kind is not None
        self.trim_margin = trim_margin
        # Recurrent layers (a hybrid model): it reads chains only, a tree as its branches (verifier/branches.py).
        self.recurrent = has_recurrent_layers(model.config)
        if self.recurrent and not hf_compat.RECORDS_RECURRENT_STATES:
            raise NotImplementedError(
                f"'{model.config._name_or_path or model.config.model_type}' has recurrent layers; verifying drafts "
                f"on it needs transformers >= 5.25 (it records the state after each token), this is "
                f"{transformers.__version__}: pip install 'transformers>=5.25,<6'")
        self._snapshots = snapshots and self.recurrent
        if direct and self.recurrent and not snapshots:
            raise ValueError(
                f"the draft model '{model.config._name_or_path or model.config.model_type}' has recurrent layers "
                "(linear attention, Mamba or convolutions), whose state cannot take back the drafts the target "
                "rejects: such a hybrid model can be the target, not the draft model; draft with an attention-only "
                "model, or with 'ngram' / 'suffix'")
        # (None: sliding layers, or queries scaled by position, which only the model's own forward hooks)
        self.direct = DirectForward.for_model(model, self.cache_kwarg) if direct and not self._temperature else None
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        # Hugging Face gives sliding and chunked layers its window cache: those are the local ones.
        self._is_local = [type(layer) is DynamicSlidingWindowLayer for layer in self.cache.layers]
        self.local_start = 0  # local layers hold slots local_start.. only (trim_windows)
        # Attention layers, sliding ones too, get slots (module docstring); recurrent ones stay.
        self.cache.layers = [SlotLayer() if isinstance(layer, DynamicLayer) else layer for layer in self.cache.layers]
        self.states = RecurrentStates([layer for layer in self.cache.layers if isinstance(layer, LinearAttentionLayer)],
                                      scan_restarts=self.model.config.get_text_config().model_type in _SCAN_RESTARTS)
        self._attends = any(isinstance(layer, SlotLayer) for layer in self.cache.layers)  # False: Mamba, all recurrent
        self.slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # committed per row
        self._pending: TreeBlock | None = None
        self._branches: Branches | None = None  # the pending block was a tree, read as these branch rows
        self._pending_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.slot_pos.shape[1]

    def _layers(self):
        """(layer, whether it is local) for each attention layer holding storage; a local layer's
        storage starts at slot local_start (see _first)."""
        for layer, local in zip(self.cache.layers, self._is_local):
            if isinstance(layer, SlotLayer) and _used(layer) is not None:
                yield layer, local

    def _first(self, local: bool) -> int:
        """The slot a layer's storage starts at."""
        return self.local_start if local else 0

    @torch.no_grad()
    def forward(self, block: TreeBlock, hidden_layers: tuple[int, ...] = (),
                inputs_embeds: torch.Tensor | None = None, also_visible: torch.Tensor | None = None,
                depth_offset: torch.Tensor | int = 0, logits_at: torch.Tensor | None = None,
                keep_all: bool = False):
        """Returns logits (B, T, V) and, if asked, {layer: hidden (B, T, d)}.

        logits_at (B,) block index per row: return only those logits, (B, V). A prefill needs one
        row of logits, not T: the LM head over a long prompt costs more than the step itself.
        (B, m) indices: m positions per row, (B, m, V) (a parallel draft model's last k).
        keep_all: each row will keep all of its block's tokens or none (a prefill); recurrent
        layers then need not record the states in between.

        Feature-level drafters (heads/feature_head.py) grow a tree one depth per call without
        accepting in between; for them:
          inputs_embeds  (B, T, d) instead of embedding block.tokens
          also_visible   (B, T, S) bool: uncommitted slots of earlier calls each node may see
                         (its ancestors), besides the committed prefix
          depth_offset   added to block.depth for the position ids (the depth below the root)
        """
        if self.recurrent and not _is_chains(block):
            if also_visible is not None or inputs_embeds is not None or logits_at is not None or keep_all:
                raise NotImplementedError("a model with recurrent layers reads a tree only as a target does: "
                                          "tokens, no logits_at / inputs_embeds / also_visible / keep_all")
            return self._forward_branches(block, hidden_layers)
        B, T = block.tokens.shape
        S = self.num_slots
        position_ids = self.lengths[:, None] + block.depth + depth_offset  # (B, T)
        direct = self.direct if set(hidden_layers) <= {-1} else None  # it returns the last state only
        if self.recurrent:
            self.states.before_forward(T, keep_all)
        if not self._attends:  # no attention layer to mask (Mamba's would read a 4D mask as padding)
            mask = None
        elif (direct is None and also_visible is None and not self.recurrent and not self.local_start
              and not self.own_masks and self._dense() and block.is_full_chain()):
            # Slot j holds position j in every row and the block continues them as a chain: plain
            # causal attention, which the model builds itself (cheaper than our 4D mask); its
            # sliding window too, as slot j is position j.
            mask = None
        else:
            prefix_ok = (self.slot_pos >= 0)[:, None, :].expand(B, T, S)
            if also_visible is not None:
                prefix_ok = prefix_ok | also_visible
            allowed = torch.cat([prefix_ok, block.ancestors], dim=-1)  # (B, T, S + T)
            mask = self._additive(allowed)
            if self.local_kind is not None:
                mask = self._with_local(mask, allowed, position_ids)
        if logits_at is not None:
            logits_at = logits_at.to(self.device)
        if direct is not None:
            logits, last = direct(self.cache, mask, position_ids, logits_at=logits_at,
                                  **({"input_ids": block.tokens} if inputs_embeds is None else
                                     {"inputs_embeds": inputs_embeds}))
            self._add_pending(block, position_ids)
            return logits, {-1: last} if hidden_layers else {}
        inputs = {"input_ids": block.tokens} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        several = logits_at is not None and logits_at.dim() == 2
        if logits_at is not None and PER_ROW_LOGITS_TO_KEEP:  # the LM head runs on those positions only
            inputs["logits_to_keep"] = logits_at if several else logits_at[:, None]
        inputs[self.cache_kwarg] = self.cache
        with self._temperature.at(position_ids) if self._temperature else contextlib.nullcontext():
            out = self.model(**inputs, attention_mask=mask, position_ids=position_ids,
                             use_cache=True, output_hidden_states=bool(hidden_layers))
        self._add_pending(block, position_ids)
        hidden = {k: out.hidden_states[k] for k in hidden_layers} if hidden_layers else {}
        if logits_at is None:
            return out.logits, hidden
        if PER_ROW_LOGITS_TO_KEEP:
            m = logits_at.shape[1] if several else 1
            if out.logits.shape[:2] != (B, m):  # the feature test in hf_compat guessed wrong
                raise RuntimeError(f"logits_to_keep with {m} position(s) per row gave logits of shape "
                                   f"{tuple(out.logits.shape)}, not ({B}, {m}, V): this transformers release "
                                   "needs verifier/hf_compat.PER_ROW_LOGITS_TO_KEEP = False")
            return (out.logits if several else out.logits[:, 0]), hidden
        rows = torch.arange(B, device=self.device)
        return out.logits[rows[:, None] if several else rows, logits_at], hidden

    def _forward_branches(self, block: TreeBlock, hidden_layers: tuple[int, ...]):
        """A tree block on a model with recurrent layers: each row's cache copied once per branch,
        each copy reading its branch as a chain (verifier/branches.py); logits and states returned
        per node of the block, as forward() returns them. accept() keeps one copy per row."""
        branches = Branches.of(block)
        self.select_rows(branches.owners)
        logits, hidden = self.forward(branches.block, hidden_layers)
        self._branches = branches
        return branches.to_tree(logits), {k: branches.to_tree(h) for k, h in hidden.items()}

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, 1, T, K) of the attention dtype: 0 where allowed, its lowest value elsewhere."""
        mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)

    def _with_local(self, full: torch.Tensor, allowed: torch.Tensor, position_ids: torch.Tensor):
        """The masks of a model with windowed layers: a sliding layer's also hides keys at
        positions <= the node's own - window; a chunked layer's, keys of other chunks."""
        slots = self.slot_pos.clone()
        if self._pending_pos.shape[1]:  # uncommitted slots of earlier calls (a tree grown a depth a call)
            slots[:, slots.shape[1] - self._pending_pos.shape[1]:] = self._pending_pos
        key_pos = torch.cat([slots, position_ids], dim=1)[:, None, :]  # (B, 1, S + T); holes are not allowed anyway
        query_pos = position_ids[:, :, None]
        if self.local_kind == "chunked_attention":
            near = key_pos // self.local_size == query_pos // self.local_size
        else:
            near = key_pos > query_pos - self.local_size
        local = self._additive((allowed & near)[:, :, self.local_start:])  # the slots local layers hold
        if not self._masks_by_kind:
            return local
        masks = {"full_attention": full, self.local_kind: local}
        if self.recurrent:  # its recurrent layers' kinds need an entry: None, they take no mask
            masks = {**dict.fromkeys(self.model.config.get_text_config().layer_types), **masks}
        return masks

    def _add_pending(self, block: TreeBlock, position_ids: torch.Tensor) -> None:
        """The block's slots join the cache as pending (position -1) until accept() or rollback();
        their positions are kept apart (the last slots' until then) for a sliding window's mask."""
        B, T = block.tokens.shape
        pending = torch.full((B, T), -1, dtype=torch.long, device=self.device)
        self.slot_pos = torch.cat([self.slot_pos, pending], dim=1)
        self._pending = block
        self._pending_pos = torch.cat([self._pending_pos, position_ids], dim=1)

    def accept(self, keep: list[list[int]]) -> None:
        """keep[b]: indices of the pending block's nodes to keep, root first, one per depth."""
        block = self._pending
        assert block is not None, "accept() without a pending forward()"
        if self._branches is not None:  # each row goes on with the copy whose branch holds its path
            kept, chosen = self._branches.kept(keep)
            self._branches = None
            self.accept(kept)
            self.select_rows(chosen)
            return
        B, T = block.tokens.shape
        start = self.num_slots - T
        K = max((len(k) for k in keep), default=0)
        prefixes = all(nodes == list(range(len(nodes))) for nodes in keep)
        if self.recurrent:
            if not prefixes:
                raise RuntimeError("a model with recurrent layers keeps a prefix of each row's chain (a tree is "
                                   f"read as its branches), not the nodes {keep}")
            self.states.keep(torch.tensor([len(nodes) for nodes in keep]))
        if prefixes:
            # Each row keeps a prefix of its block (plain steps, chains): nothing moves.
            counts = torch.tensor([len(nodes) for nodes in keep], device=self.device)
            self._crop_to(start + K)
            offsets = torch.arange(K, device=self.device)
            self.slot_pos[:, start:] = torch.where(offsets < counts[:, None], self.lengths[:, None] + offsets, -1)
            self.lengths += counts
            self._settle()
            self._maybe_compact()
            if self._snapshots:
                self.states.snapshot(self.lengths)
            return
        index = torch.zeros(B, K, dtype=torch.long)
        kept = torch.zeros(B, K, dtype=torch.bool)
        for b, nodes in enumerate(keep):
            index[b, : len(nodes)] = torch.as_tensor(nodes, dtype=torch.long)
            kept[b, : len(nodes)] = True
        index, kept = index.to(self.device), kept.to(self.device)
        counts = kept.sum(1)
        for layer, local in self._layers():  # move the kept slots to the front of the block
            first = self._first(local)
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (B, H, S - first, hd)
                gather = index[:, None, :, None].expand(t.shape[0], t.shape[1], K, t.shape[3])
                moved = t[:, :, start - first:].gather(2, gather)
                t[:, :, start - first : start - first + K] = moved
        self._crop_to(start + K)
        self.slot_pos[:, start:] = torch.where(
            kept, self.lengths[:, None] + torch.arange(K, device=self.device), torch.full_like(index, -1))
        self.lengths += counts
        self._settle()
        self._maybe_compact()

    def _settle(self) -> None:
        """No slot is pending any more (accepted, rolled back or cropped)."""
        self._pending = None
        self._pending_pos = self._pending_pos[:, :0]

    def _dense(self) -> bool:
        """Every row holds exactly num_slots committed tokens, so slot j is position j (no holes)."""
        S = self.num_slots
        return S == 0 or bool((self.lengths == S).all())

    def feed(self, rows: list[list[int]]) -> torch.Tensor:
        """Commit each row's tokens (one at least) and return the logits after each row's last
        one, (B, V). One pass; for a model with recurrent layers, rows of different lengths over
        FEED_RECORDED tokens take a pass per distinct length, so no state between is recorded."""
        lengths = [len(r) for r in rows]
        ends = sorted(set(lengths)) if self.recurrent and max(lengths) > FEED_RECORDED else [max(lengths)]
        logits, done = None, 0
        for end in ends:
            pieces = [r[done:end] for r in rows]
            last = torch.tensor([max(min(n, end) - done - 1, 0) for n in lengths], device=self.device)
            step, _ = self.forward(TreeBlock.chains(pieces, self.device), logits_at=last, keep_all=len(ends) > 1)
            self.accept([list(range(len(piece))) for piece in pieces])
            ending = torch.tensor([done < n <= end for n in lengths], device=self.device)
            logits = step if logits is None else torch.where(ending[:, None], step, logits)
            done = end
        return logits

    def reachable(self, new_lengths: torch.Tensor) -> torch.Tensor:
        """new_lengths, or 0 (the row fed afresh) for a row that rollback() cannot take there: its
        sliding or chunked layers let go of keys a token that far back would see (trim_windows: it
        may go back trim_margin positions). A drafter whose rounds may go back further asks first."""
        if not self.local_start:
            return new_lengths  # (where it was: a drafter's list of lengths stays on the host)
        new_lengths = new_lengths.to(self.device)
        return torch.where(self.lengths - new_lengths > self.trim_margin, 0, new_lengths)

    def rollback(self, new_lengths: torch.Tensor) -> None:
        """Forget every slot whose position is >= new_lengths[b] (lengths only shrink)."""
        new_lengths = new_lengths.to(self.device)
        if self.local_start:  # those layers let go of the keys a token further back would see
            too_far = self.reachable(new_lengths) != new_lengths
            if bool(too_far.any()):
                back = int((self.lengths - new_lengths)[too_far].max())
                raise RuntimeError(f"rollback() of {back} positions on a cache whose sliding or chunked "
                                   f"layers let go of slots (trim_windows) with trim_margin {self.trim_margin}: "
                                   "it may go back at most trim_margin positions, or to 0")
        if self.recurrent:
            if not self._snapshots or self._pending is not None:
                raise NotImplementedError("a model with recurrent layers cannot forget tokens: its state has folded "
                                          "them in (a draft model's cache keeps snapshots of accepted lengths only)")
            self.states.restore(torch.minimum(self.lengths, new_lengths), self.lengths)
        self.slot_pos = torch.where(self.slot_pos >= new_lengths[:, None], -1, self.slot_pos)
        self.lengths = torch.minimum(self.lengths, new_lengths)
        live = (self.slot_pos >= 0).any(0).nonzero()
        self._crop_to(int(live.max()) + 1 if live.numel() else 0)
        self._settle()  # a pending block's slots (-1) were the last ones: cropped with the rest
        self._maybe_compact()

    def select_rows(self, indices: list[int]) -> None:
        assert self._branches is None, "select_rows() between a tree's forward() and accept()"
        ix = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        for layer, _ in self._layers():
            layer.keys, layer.values = layer.keys[ix], layer.values[ix]
        self.states.select_rows(ix)
        self.slot_pos, self.lengths = self.slot_pos[ix], self.lengths[ix]
        self._pending_pos = self._pending_pos[ix]
        self._maybe_compact()

    def add_rows(self, other: "CachedLM | int") -> None:
        """Rows join the batch after the current ones: another CachedLM's over the same model (their
        prompts prefilled apart), or `other` empty rows that hold nothing yet (a drafter whose
        cache catches up on its own). The shorter side is padded with holes to the longer's slots."""
        if isinstance(other, int):
            joined_pos = torch.full((other, 0), -1, dtype=torch.long, device=self.device)
            joined_lengths = torch.zeros(other, dtype=torch.long, device=self.device)
            joined_layers = [None] * len(self.cache.layers)
        else:
            assert other._pending is None, "add_rows() from a cache with a pending forward()"
            assert not other.local_start, "add_rows() from a cache whose windowed layers were trimmed"
            joined_pos, joined_lengths = other.slot_pos, other.lengths
            joined_layers = [_used(layer) if isinstance(layer, SlotLayer) else None for layer in other.cache.layers]
        assert self._pending is None, "add_rows() between forward() and accept()"
        # Where local layers let go of slots, the joining rows start after them: holes before.
        shift = self.local_start
        joined_pos = torch.cat([joined_pos.new_full((len(joined_pos), shift), -1), joined_pos], dim=1)
        S = max(self.num_slots, joined_pos.shape[1])
        rows = (self.slot_pos.shape[0], joined_pos.shape[0])
        self.states.add_rows(None if isinstance(other, int) else other.states, *rows)
        for layer, theirs, local in zip(self.cache.layers, joined_layers, self._is_local):
            if not isinstance(layer, SlotLayer):
                continue
            mine = _used(layer)
            if mine is None and theirs is None:
                continue
            like = (mine or theirs)[0]
            first = self._first(local)  # local layers hold slots shift.. of both parts
            if theirs is not None and not local and shift:
                theirs = tuple(torch.cat([_holes_to(None, len(t), shift, t), t], dim=2) for t in theirs)
            keys, values = (torch.cat([_holes_to(None if part is None else part[i], n, S - first, like)
                                       for part, n in zip((mine, theirs), rows)]) for i in (0, 1))
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        self.slot_pos = torch.cat([_holes_to(pos, len(pos), S, pos, fill=-1) for pos in (self.slot_pos, joined_pos)])
        self.lengths = torch.cat([self.lengths, joined_lengths])
        self._pending_pos = self.slot_pos[:, :0]

    def _crop_to(self, num_slots: int) -> None:
        # (cut below local_start, as a rollback of every row to 0 does, local layers hold nothing)
        self.local_start = min(self.local_start, num_slots)
        for layer, local in self._layers():
            layer.truncate(num_slots - self._first(local))
        self.slot_pos = self.slot_pos[:, :num_slots]

    def _maybe_compact(self, slack: float = 0.25) -> None:
        """Holes cost attention time; squeeze them out once they are a quarter of the cache. With
        trim_windows, local layers let go of the leading slots no later token sees there too, or
        on their own once those are a quarter of what they hold."""
        S = self.num_slots
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if S - longest > max(16, int(slack * S)):
            # Sort each row's slots by position (holes last): the cache becomes left-aligned again.
            key = torch.where(self.slot_pos >= 0, self.slot_pos, S + torch.arange(S, device=self.device))
            self._reorder(key.argsort(dim=1)[:, :longest])  # (B, longest)
        # (a cheap bound first: most rounds hold too few slots past local_start to let any go, and
        # the count below costs tensor ops and a sync each round)
        elif self.trim_windows and self._pending is None and S - self.local_start >= TRIM_MIN_SLOTS:
            unseen = self._unseen_prefix(self.slot_pos)  # pending slots would read as holes: never then
            if unseen - self.local_start >= max(TRIM_MIN_SLOTS, int(slack * (S - self.local_start))):
                for layer, local in self._layers():  # a copy, so that the storage before is freed
                    if local:
                        cut = unseen - self.local_start
                        layer.keys, layer.values = (t[:, :, cut:].contiguous() for t in (layer.keys, layer.values))
                self.local_start = unseen

    def _reorder(self, order: torch.Tensor) -> None:
        """Slot j of each row b becomes old slot order[b, j]. With trim_windows, local layers then
        hold the slots from the first one a later token may see. An old slot they no longer hold
        lands only where no later token sees it (it was unseen, and stays so): any key fills it."""
        slot_pos = self.slot_pos.gather(1, order)
        start = self._unseen_prefix(slot_pos) if self.trim_windows else 0
        for layer, local in self._layers():
            index = (order[:, start:] - self.local_start).clamp_min(0) if local else order
            k, v = layer.keys, layer.values  # read both before assigning: assignment resizes the views
            # Keys and values may differ in heads and width (MLA caches two latents: 512 and 64 wide).
            layer.keys, layer.values = (t.gather(2, index[:, None, :, None].expand(*t.shape[:2], index.shape[1],
                                                                                   t.shape[3])) for t in (k, v))
        self.slot_pos, self.local_start = slot_pos, start

    def _unseen_prefix(self, slot_pos: torch.Tensor) -> int:
        """How many leading slots no later token of any row sees through a local layer: holes, and
        keys at positions k <= length - window (sliding), or in an earlier chunk (chunked). Later
        tokens of row b sit at positions >= lengths[b] - trim_margin."""
        lengths = self.lengths[:, None] - self.trim_margin  # a rollback may go back so far
        if self.local_kind == "chunked_attention":
            unseen = slot_pos // self.local_size < lengths // self.local_size
        else:
            unseen = slot_pos <= lengths - self.local_size
        unseen = (unseen | (slot_pos < 0)).all(0)
        return int(unseen.long().cumprod(0).sum())

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's stored keys and values (B, H, n, hd) and each stored slot's position (B, n), -1
        for a hole: what a drafter attending to the target's own keys reads (a trimmed local layer
        holds the slots from local_start on)."""
        lay = self.cache.layers[layer]
        first = self.local_start if self._is_local[layer] else 0
        return lay.keys, lay.values, self.slot_pos[:, first:]

    def committed_kv(self, row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(H, L, hd) keys and values of a row's committed slots in position order (for tests)."""
        lay = self.cache.layers[layer]
        first = self.local_start if self._is_local[layer] else 0  # a trimmed local layer: the slots it holds
        pos = self.slot_pos[row, first:]
        order = pos.argsort()[(pos < 0).sum():]
        return lay.keys[row][:, order], lay.values[row][:, order]


def has_recurrent_layers(config) -> bool:
    """Whether a model of this config has recurrent layers (linear attention, Mamba, convolutions:
    a hybrid), as Hugging Face's cache lays them out."""
    return any(type(layer) is LinearAttentionLayer for layer in DynamicCache(config=config).layers)


def _is_chains(block: TreeBlock) -> bool:
    """Every row of the block is a chain (padded at its end)."""
    chain = torch.arange(-1, block.tokens.shape[1] - 1, device=block.parents.device)
    return bool(((block.parents == chain) | ~block.valid).all())


FEED_RECORDED = 16  # CachedLM.feed: up to this many tokens a row, record the states in one pass
TRIM_MIN_SLOTS = 64  # trim_windows: local layers let go of no fewer slots at a time (a copy each)
# Model types whose multi-token scan ignores the cached state (verifier/recurrent_state.py)
_SCAN_RESTARTS = {"mamba", "falcon_mamba", "jamba"}


_DUMMY_LAYER = getattr(cache_utils, "DummyLayer", DynamicLayer)  # holds nothing (an MLP-only layer); from 5.24


def _local_attention(config) -> tuple[str | None, int | None, bool]:
    """(the kind of the model's windowed layers, "sliding_attention" or "chunked_attention", or None
    where it has none; their window or chunk size; whether its forward takes a mask per layer
    kind, as models with `layer_types` do). Layers other than full, sliding and chunked attention
    and recurrent ones (verifier/recurrent_state.py) are refused, naming what is not supported."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None) or []
    if "local" in (getattr(text, "attention_layers", None) or []) and text.model_type == "gpt_neo":
        raise NotImplementedError(
            "GPT-Neo's local attention layers mask keys by their slot in the cache (a causal buffer of their own), "
            "not by position: draftsman's cache holds holes (rejected drafts, rows of different lengths), so their "
            f"window of {text.window_size} would cut the wrong keys and the output would not be the model's own: "
            "not supported; GPT-J (gptj) is the same family without local layers")
    if "chunked_attention" in types and "sliding_attention" in types:
        raise NotImplementedError("a model with both sliding-window and chunked attention layers is not supported yet")
    windows = set()
    for layer in DynamicCache(config=config).layers:
        if type(layer) is DynamicSlidingWindowLayer:  # Hugging Face's cache for chunked layers too
            windows.add(layer.sliding_window)
        elif type(layer) not in (DynamicLayer, LinearAttentionLayer, _DUMMY_LAYER):
            raise NotImplementedError(
                f"cache layer {type(layer).__name__} (attention and a recurrent mixer in one layer, indexed "
                "sparse attention, shared KV) is not supported yet: draftsman verifies on models whose layers "
                "attend fully, through a sliding window or in chunks, or are recurrent (linear attention, Mamba, "
                "convolution)")
    if "chunked_attention" in types:
        return "chunked_attention", text.attention_chunk_size, True
    if len(windows) > 1:
        raise NotImplementedError(f"sliding-window layers with different windows {sorted(windows)} are not "
                                  "supported yet")
    return ("sliding_attention" if windows else None), (windows.pop() if windows else None), bool(types)


def _used(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A cache layer's (keys, values), or None while it holds no storage. A layer whose rows have
    all ended has 0 rows but still its slots: it must be cropped and compacted with slot_pos, and
    rows that join are padded to those slots, so "no row" is not "no storage"."""
    return (layer.keys, layer.values) if layer.is_initialized and layer.keys is not None else None


def _holes_to(t: torch.Tensor | None, rows: int, slots: int, like: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """`t` (rows, ..., slots', ...) widened to `slots` along its slot dimension (2 for keys /
    values, 1 for slot positions), the new slots holes; None: all holes, shaped like `like`."""
    dim = 1 if like.dim() == 2 else 2
    shape = list(like.shape)
    shape[0], shape[dim] = rows, slots
    out = like.new_full(shape, fill)
    if t is not None:
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out
