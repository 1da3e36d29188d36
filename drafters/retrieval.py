"""`retrieval`: REST-style drafting from a datastore (He et al., 2024, "REST: Retrieval-Based
Speculative Decoding"). Where the target writes text like a corpus you have (your code base, your
docs, past answers), the tokens that followed the context's last few tokens there are good
guesses. `ngram` looks in the prompt; this looks in the datastore, and the two combine in a
`cascade`.

The datastore (drafters/datastore.py) is read and tokenized with the target's tokenizer when the
drafter is built, or loaded from an index `draftsman datastore` built ahead
(drafters/datastore_index.py). Each round the longest suffix of the context (max_ngram down to
min_ngram tokens) found in it gives its continuations, the most frequent `branches` of them
merged into one tree. Proposals are deterministic, so verification is exact at any temperature.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .base import Drafter
from .datastore import Datastore, read_documents
from .datastore_index import is_index, load_index
from .ngram import _Trie, draftable
from .path_bans import PathBans
from .registry import register


@register
class RetrievalDrafter(Drafter):
    name = "retrieval"

    @dataclass
    class Options:
        # The datastore: a text file, a JSONL file of {"text": ...} lines, a folder of such files, or
        # an index built from them ahead (`draftsman datastore`, a .safetensors file).
        path: str = ""  # datastore: a text or JSONL file, a folder of them, or an index `draftsman datastore` built
        k: int = 4  # tokens proposed per branch (4 beat 6 on the bundled target: docs/choosing-a-drafter.md)
        min_ngram: int = 2  # shortest suffix looked up
        max_ngram: int = 4  # longest suffix, tried first
        branches: int = 2  # most frequent continuations merged into one tree (2 beat 4 there too)
        max_matches: int = 256  # occurrences of a suffix read per lookup (the first ones in the datastore)

        def __post_init__(self):
            if not self.path:
                raise ValueError("retrieval: path is required: the datastore (a text file, a JSONL file of "
                                 '{"text": ...} lines, or a folder of such files)')
            if min(self.k, self.branches, self.max_matches) < 1:
                raise ValueError(f"retrieval: k, branches and max_matches must be >= 1 (got k={self.k}, "
                                 f"branches={self.branches}, max_matches={self.max_matches})")
            if not 1 <= self.min_ngram <= self.max_ngram:
                raise ValueError(f"retrieval: need 1 <= min_ngram <= max_ngram (got {self.min_ngram}, "
                                 f"{self.max_ngram})")

    def __init__(self, options: "RetrievalDrafter.Options", target=None):
        self.options = options
        if target is None or target.tokenizer is None:
            raise ValueError("retrieval: the target folder has no tokenizer, and the datastore is text: give the "
                             "target its tokenizer files")
        self.device = target.device
        t0 = time.perf_counter()
        sizes = range(options.min_ngram, options.max_ngram + 1)
        if is_index(options.path):  # built ahead by `draftsman datastore`
            self.datastore, meta = load_index(options.path, target.tokenizer, sizes, target=str(target.path))
            documents, seconds = int(meta["documents"]), "load_seconds"
        else:
            texts = read_documents(options.path)
            self.datastore = Datastore.from_texts(texts, target.tokenizer, sizes)
            documents, seconds = len(texts), "build_seconds"
        outside = self.datastore.tokens.max().item() if len(self.datastore) else -1
        if outside >= target.vocab_size:
            raise ValueError(f"retrieval: the tokenizer gave token id {outside}, outside the target's vocabulary "
                             f"of {target.vocab_size}")
        self.build_report = {"documents": documents, "tokens": len(self.datastore),
                             seconds: round(time.perf_counter() - t0, 2)}
        self.prompt_lengths: list[int] = []

    def max_depth(self) -> int:
        return self.options.k

    def begin(self, prompts, sampling, generator):
        super().begin(prompts, sampling, generator)
        self.prompt_lengths = [len(p) for p in prompts]
        # A continuation ends before a token its row bans there: a -100 logit_bias, a bad word, a
        # repeated n-gram (drafters/path_bans.py).
        self.path_bans = PathBans(everywhere=True)

    def keep_rows(self, indices):
        self.prompt_lengths = [self.prompt_lengths[i] for i in indices]
        self.path_bans.select_rows(indices)

    can_add_rows = True

    def add_rows(self, prompts, target_hidden):
        self.prompt_lengths += [len(p) for p in prompts]

    def propose(self, contexts):
        o = self.options
        trees = []
        minimums = self.min_new_tokens_per_row(len(contexts))
        path_bans = self.path_bans.round(self.draft_sampling(), contexts, self.grammar)
        for b, (ctx, prompt_length, least) in enumerate(zip(contexts, self.prompt_lengths, minimums)):
            trie = _Trie([], [])
            banned_depths = least - (len(ctx) - prompt_length)  # EOS held back (ngram's rule)
            if self.grammar is not None:  # what the grammar forces next, first (as ngram)
                trie.insert(self.grammar.forced(b)[:o.k])
            for cont in self.datastore.continuations(ctx, o.k, o.branches, o.max_matches):
                trie.insert(draftable(cont, banned_depths, self.eos_token_ids, path_bans, b))
            trees.append(trie.tree(self.device))
        return trees

    def report(self) -> dict:
        return {"datastore": self.build_report}
