"""A base for the toy drafters tests register: the `k` option, the constructor and `max_depth`
that every one of them would otherwise repeat. A subclass sets `name` and writes `propose`.
And `watching_proposals`, to see what a loaded drafter proposes."""
import contextlib
from dataclasses import dataclass

from draftsman.drafters import Drafter


class ToyDrafter(Drafter):
    @dataclass
    class Options:
        k: int = 4  # draft length

    def __init__(self, options, target):
        self.k = options.k
        self.vocab = target.vocab_size

    def max_depth(self):
        return self.k


@contextlib.contextmanager
def watching_proposals(dec, watch):
    """Within it, watch(contexts, trees) sees every round's proposal of dec's drafter."""
    propose = dec.drafter.propose

    def record(contexts):
        trees = propose(contexts)
        watch(contexts, trees)
        return trees

    dec.drafter.propose = record
    try:
        yield
    finally:
        del dec.drafter.propose
