"""Drafters propose token trees for the shared verifier. Importing this package registers the
built-in ones."""
from .base import (DETERMINISTIC, IID, WITHOUT_REPLACEMENT, Drafter, DraftTree, RoundFeedback,  # noqa: F401
                   TargetNeeds)
from .registry import TargetInfo, available, build_drafter, register  # noqa: F401
from . import none, ngram, retrieval, draft_model, cascade, medusa, eagle, mtp  # noqa: F401,E402  (registration side effect)
