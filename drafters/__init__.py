"""Drafters propose token trees for the shared verifier. Importing this package registers the
built-in ones."""
from .base import (DETERMINISTIC, IID, WITHOUT_REPLACEMENT, Drafter, DraftTree, RoundFeedback,  # noqa: F401
                   TargetNeeds)
from .registry import TargetInfo, available, build_drafter, check_drafter_config, register  # noqa: F401
# registration side effect:
from . import (none, ngram, retrieval, suffix, recycling, draft_model, cross_tokenizer, cascade, medusa,  # noqa: F401,E402
               eagle, mtp, native_mtp, gemma4_assistant, mlp_speculator, layer_skip)
