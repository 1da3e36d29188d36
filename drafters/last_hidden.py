"""Per-row bookkeeping for drafters that read the target's last hidden state at the position
that predicted each row's root (`medusa`, `mlp_speculator`, `gemma4_assistant`; needs
hidden_state_layers=(-1,)): the verifier hands it back after the prefill and after every round,
so these drafters need no target pass of their own."""
from __future__ import annotations

import torch

from .repeats import DraftContext


class LastHiddenRows:
    """Mixed in before Drafter. Keeps `last_hidden` (one (d,) state per row, None until a row has
    one: a one-token prompt drafts nothing in round 1) and the rows' DraftContext (the request's
    rules) as rows finish and join. Call begin_rows() from begin()."""

    def begin_rows(self, prompts: list[list[int]], vocab_size: int) -> None:
        self.last_hidden: list[torch.Tensor | None] = [None for _ in prompts]
        self.draft_context = DraftContext(prompts, vocab_size, self.device)

    def observe_prefill(self, target_hidden, first_row: int = 0):
        for b, hidden in enumerate(target_hidden, start=first_row):
            if hidden:  # the prompt's second-to-last position predicted the root
                self.last_hidden[b] = hidden[-1][-1]

    def observe(self, feedback):
        for b, hidden in enumerate(feedback.target_hidden):
            self.last_hidden[b] = hidden[-1][-1]  # the newest accepted position: it predicted the root

    def keep_rows(self, indices):
        self.last_hidden = [self.last_hidden[i] for i in indices]
        self.draft_context.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        first = len(self.last_hidden)
        self.last_hidden += [None for _ in prompts]
        self.draft_context.add_rows(prompts)
        self.observe_prefill(target_hidden, first)
