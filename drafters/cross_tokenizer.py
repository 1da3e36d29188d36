"""`cross_tokenizer`: a small causal LM whose tokenizer differs from the target's drafts through
text, as Hugging Face's universal assisted generation does. Each round, per row:

1. the target's tokens so far are decoded to text and encoded with the draft model's tokenizer,
   a round at a time (drafters/text_ids.py: the new tokens decoded, the text's end encoded
   again); the draft model's KV cache keeps the longest prefix it already holds of those ids;
2. the draft model drafts `k` tokens greedily, which are decoded to text;
3. that text is encoded with the target's tokenizer after the row's last few tokens, and the
   target's tokens that follow them become a deterministic chain.

That chain is deterministic, so the verifier keeps the target's distribution whatever it holds;
the text bridge only decides how many drafts are accepted. Where a boundary re-tokenizes
differently (a word split across the last target token and the draft text), the drafted text is
encoded alone, which the target may reject.

Sampled rounds (T > 0) draw each draft token instead, from the draft model's distribution over
the tokens both vocabularies spell the same (as transformers' universal speculative decoding
does): each such token is one target token, and the distribution it was drawn from, placed in
the target's vocabulary, is its q, so rejection sampling stays exact. A greedy chain there is
accepted only as often as the target samples the draft model's argmax.

Use `draft_model` when the tokenizers are the same: it needs no text round trip."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models import check_model_folder, context_length, load_causal_lm, load_tokenizer
from ..verifier.cached_model import CachedLM
from ..verifier.tree import TreeBlock
from .base import DETERMINISTIC, Drafter, DraftTree
from .chain_draws import chain_trees, draw_step
from .context_window import window_start
from .draft_vocab import full_vocab
from .registry import register
from .text_ids import REENCODED, TextIds

TAIL = 4  # target tokens re-encoded with the drafted text, so a word they begin is continued as one


@register
class CrossTokenizerDrafter(Drafter):
    name = "cross_tokenizer"

    @dataclass
    class Options:
        path: str | None = None  # local Hugging Face folder of the draft model, with its own tokenizer
        k: int = 4  # tokens the draft model drafts per round (its own tokens)
        dtype: str | None = None  # default: the target's dtype

        def __post_init__(self):
            if not self.path:
                raise ValueError("cross_tokenizer: set drafter.path to the draft model's local folder")
            if self.k < 1:
                raise ValueError(f"cross_tokenizer: k must be >= 1, got {self.k}")

    def __init__(self, options: "CrossTokenizerDrafter.Options", target):
        self.options, self.k = options, options.k
        if target.tokenizer is None:
            raise ValueError(f"cross_tokenizer drafts through text, but the target '{target.path}' has no "
                             "tokenizer files: add them to its folder")
        check_model_folder(options.path, "drafter.path")  # named as missing, not as a folder without a tokenizer
        tokenizer = load_tokenizer(options.path)
        if tokenizer is None:
            raise ValueError(f"cross_tokenizer drafts through text, but the draft model '{options.path}' has no "
                             "tokenizer files (tokenizer.json or tokenizer_config.json): add its own tokenizer")
        dtype = options.dtype or str(target.dtype).replace("torch.", "")
        model = load_causal_lm(options.path, dtype, target.device, what="drafter.path")
        self.target_tokenizer, self.tokenizer = target.tokenizer, tokenizer
        self.vocab_size = target.vocab_size
        self.draft_eos = {t for t in (tokenizer.eos_token_id, model.config.eos_token_id) if isinstance(t, int)}
        self._parameters = sum(p.numel() for p in model.parameters())
        # Sliding and chunked layers keep about a window (as draft_model's do). A round goes back
        # over the drafts it fed (k - 1) and the ids re-encoded with the new text (and their anchor);
        # a row that must go back further (its whole text encoded again) is fed afresh.
        self.lm = CachedLM(model, direct=True, trim_windows=True, trim_margin=self.k + REENCODED + 1)
        self.context = context_length(model.config)
        if self.k >= self.context:
            raise ValueError(f"cross_tokenizer: k={self.k} leaves no room in the draft model's context of "
                             f"{self.context} positions: set drafter.k below it")
        self._share_vocabularies(target.tokenizer, tokenizer, model.get_output_embeddings().weight.shape[0])
        self.held: list[list[int]] = []  # each row's draft-model ids in its cache
        self.text_ids = TextIds(target.tokenizer, tokenizer)  # each row's text in the draft model's ids
        self.bridged = self.fallbacks = 0  # rounds whose drafted text joined the row's tail / was encoded alone
        self.fed_afresh = 0  # rows whose cache went back further than its window layers kept

    def _share_vocabularies(self, target_tokenizer, tokenizer, draft_width: int) -> None:
        """The tokens both vocabularies hold, spelled the same: the ones sampled rounds draw from
        (as transformers' universal speculative decoding does). shared_draft / shared_target:
        their ids in each; None when there are none."""
        target_ids = target_tokenizer.get_vocab()
        pairs = sorted((i, target_ids[token]) for token, i in tokenizer.get_vocab().items()
                       if token in target_ids and target_ids[token] < self.vocab_size and i < draft_width)
        self.shared_draft = self.shared_target = None
        self._target_of_draft = None
        if pairs:
            device = self.lm.device
            self.shared_draft = torch.tensor([d for d, _ in pairs], device=device)
            self.shared_target = torch.tensor([t for _, t in pairs], device=device)
            self._target_of_draft = torch.full((draft_width,), -1, dtype=torch.long, device=device)
            self._target_of_draft[self.shared_draft] = self.shared_target

    def max_depth(self) -> int:
        return 2 * self.k  # target tokens of k draft tokens' text: at most this many are proposed

    def extra_parameters(self) -> int:
        return self._parameters

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.lm.reset(len(prompts))
        self.held = [[] for _ in prompts]
        self.text_ids.reset(len(prompts))
        self.bridged = self.fallbacks = self.fed_afresh = 0

    def keep_rows(self, indices):
        self.lm.select_rows(indices)
        self.held = [self.held[i] for i in indices]
        self.text_ids.keep_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        self.lm.add_rows(len(prompts))
        self.held += [[] for _ in prompts]
        self.text_ids.add_rows(len(prompts))

    def report(self) -> dict:
        return {"bridged_rounds": self.bridged, "text_alone_rounds": self.fallbacks,
                "shared_tokens": 0 if self.shared_draft is None else len(self.shared_draft),
                "text_encoded_whole": self.text_ids.whole, "text_encoded_end": self.text_ids.extended,
                "rows_fed_afresh": self.fed_afresh}

    def propose(self, contexts):
        k = self.k if self.depth_limit is None else min(self.k, self.depth_limit)
        device = self.lm.device
        if k <= 0:
            return [DraftTree.empty(device) for _ in contexts]
        wants = [self._draft_ids(b, context) for b, context in enumerate(contexts)]
        # 1. Keep each row's cached prefix of its ids (one id at least is fed, for its logits).
        asked = [min(_common_prefix(held, want), len(want) - 1) for held, want in zip(self.held, wants)]
        kept = self.lm.reachable(torch.tensor(asked)).tolist()  # a trimmed cache goes back so far only
        self.fed_afresh += sum(n != a for n, a in zip(kept, asked))
        self.lm.rollback(torch.tensor(kept))
        unseen = [want[n:] for want, n in zip(wants, kept)]
        last = torch.tensor([len(u) - 1 for u in unseen], device=device)
        logits, _ = self.lm.forward(TreeBlock.chains(unseen, device), logits_at=last)
        self.lm.accept([list(range(len(u))) for u in unseen])
        # 2. k draft tokens per row: greedy, or in sampled rounds drawn among the shared tokens.
        sampled = not self.shape_sampling().greedy
        if sampled and self.shared_draft is None:  # no token of one vocabulary is in the other
            self.held = wants
            return [DraftTree.empty(device) for _ in contexts]
        drafted, probs = [], []
        for step in range(k):
            if sampled:
                p, index = draw_step(logits[:, self.shared_draft], self.draft_sampling(), self.generator)
                probs.append(p)
                token = self.shared_draft[index]
            else:
                token = logits.argmax(-1)
            drafted.append(token)
            if step < k - 1:
                logits, _ = self.lm.forward(TreeBlock.column(token))
                logits = logits[:, 0]
                self.lm.accept([[0]] * len(contexts))
        drafted = torch.stack(drafted, 1)  # (B, k)
        drafted_ids = drafted.tolist()
        self.held = [want + ids[:-1] for want, ids in zip(wants, drafted_ids)]  # the last was never fed
        if sampled:
            return self._sampled_chains(drafted, drafted_ids, probs)
        # 3. Their text in the target's tokens.
        trees = []
        depth = self.max_depth() if self.depth_limit is None else min(self.max_depth(), self.depth_limit)
        for b, (context, want, ids) in enumerate(zip(contexts, wants, drafted_ids)):
            cut = next((j for j, t in enumerate(ids) if t in self.draft_eos), len(ids))
            tokens = self._target_tokens(context, self._text_after(want, ids[:cut]))[:depth]
            tokens = tokens[: next((j for j, t in enumerate(tokens) if t >= self.vocab_size), len(tokens))]
            if self.grammar is not None:  # drafts only: what the grammar forbids would be rejected
                tokens = tokens[: self.grammar.fits(b, tokens)]
            trees.append(DraftTree.chain(tokens, DETERMINISTIC, device=device))
        return trees

    def _sampled_chains(self, drafted: torch.Tensor, drafted_ids: list[list[int]],
                        probs: list[torch.Tensor]) -> list[DraftTree]:
        """Sampled rounds' chains: each draft token is a shared token, so it is one target token,
        and the distribution it was drawn from, put in the target's vocabulary, is its q."""
        target_tokens = self._target_of_draft[drafted]  # (B, k)
        # An IID chain may not run past the row's own end (a sampled EOS ends it).
        lengths = [next((j + 1 for j, t in enumerate(row) if t in self.draft_eos), len(row))
                   for row in drafted_ids]
        q_of = lambda: full_vocab(torch.stack(probs, 1), self.shared_target, self.vocab_size)  # noqa: E731
        return chain_trees(target_tokens, lengths, self.draft_sampling(), q_of)

    def _draft_ids(self, b: int, context: list[int]) -> list[int]:
        """The row's text so far in the draft model's ids; past the draft model's context, a window
        of the latest ids that leaves room for k drafts (drafters/context_window.py)."""
        ids = self.text_ids.ids(b, context) or [self._any_start()]
        return ids[window_start(len(ids), self.context - self.k):]

    def _any_start(self) -> int:
        """An id to start from when the text is empty (a prompt of special tokens only)."""
        tok = self.tokenizer
        for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id):
            if isinstance(t, int):
                return t
        return 0

    def _text_after(self, held: list[int], drafted: list[int]) -> str:
        """The text the drafted ids add after the held ones (decoded with a few held ids before
        them: a tokenizer may write a token's leading space only after another token)."""
        if not drafted:
            return ""
        window = held[-TAIL:]
        before = self.tokenizer.decode(window, skip_special_tokens=True)
        whole = self.tokenizer.decode(window + drafted, skip_special_tokens=True)
        if whole.startswith(before):
            return whole[len(before):]
        return self.tokenizer.decode(drafted, skip_special_tokens=True)

    def _target_tokens(self, context: list[int], text: str) -> list[int]:
        """The target's tokens for `text` after the row's tokens: the row's last few tokens and
        the text encoded together, when that keeps those tokens as they are; else the text alone."""
        if not text:
            return []
        tail = context[-TAIL:]
        encode = lambda s: self.target_tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
        joined = encode(self.target_tokenizer.decode(tail, skip_special_tokens=False) + text)
        if joined[: len(tail)] == tail:
            self.bridged += 1
            return joined[len(tail):]
        self.fallbacks += 1
        return encode(text)


def _common_prefix(a: list[int], b: list[int], chunk: int = 64) -> int:
    """How many ids a and b share from the start. Compares a chunk at a time (list equality runs
    in C): the ids of a long row are nearly all shared, round after round."""
    n, end = 0, min(len(a), len(b))
    while n + chunk <= end and a[n: n + chunk] == b[n: n + chunk]:
        n += chunk
    while n < end and a[n] == b[n]:
        n += 1
    return n
