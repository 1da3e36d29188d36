"""What differs between the transformers 5.x releases that pyproject admits.

The KV-cache argument of the models' forward (and of their layers and attention modules) was
renamed from `past_key_values` to `cache` during 5.x; newer releases still take the old name with a
deprecation warning until 5.40, older ones ignore an unknown `cache=` and silently run without one.
So the cache is passed by whatever name the installed model's forward declares.
"""
from __future__ import annotations

import inspect

import torch


def cache_kwarg(model: torch.nn.Module) -> str:
    """'cache' or 'past_key_values': the name `model.forward` takes its KV cache by. Reads the
    signature (through functools.wraps decorators): look it up once per model, not per call."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _takes_per_row_logits_to_keep() -> bool:
    # Releases with modeling_utils.slice_logits_to_keep accept a (B, k) index tensor (one set of
    # positions per row); older ones index every row with the whole tensor.
    from transformers import modeling_utils
    return hasattr(modeling_utils, "slice_logits_to_keep")


PER_ROW_LOGITS_TO_KEEP = _takes_per_row_logits_to_keep()


def _records_recurrent_states() -> bool:
    # Releases whose hybrid models record the recurrent state after each token of a pass
    # (Cache.get_recurrent_states_to_keep, from 5.25): what verifying drafts on a hybrid target
    # needs (verifier/recurrent_state.py). Older ones record the conv inputs only.
    from transformers import DynamicCache
    return hasattr(DynamicCache, "get_recurrent_states_to_keep")


RECORDS_RECURRENT_STATES = _records_recurrent_states()
