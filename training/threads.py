"""The CPU thread count a run asks for, and the caller's, put back when the run ends.

Each trainer (and the vocab count) sets torch's thread count from its config's `threads`. That
count is the whole process's: a notebook, a server or a test process that calls a trainer and
then decodes would go on with the run's threads, and a process that runs beside others on the
same cores (pytest's workers) then oversubscribes them: OpenMP's threads wait on each other, and
a test that takes 1.7 s alone took 8.5 s.
"""
from __future__ import annotations

import functools


def restores_torch_threads(run):
    """`run` may set torch's thread count; its caller's is back when it returns or raises."""
    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        import torch  # here: `draftsman vocab --help` imports no torch

        before = torch.get_num_threads()
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapper
