"""draftsman: exact speculative decoding with pluggable drafters and one shared verifier."""
from .api import Decoder, GenerationOutput, GenerationStats, JoiningPrompt, load  # noqa: F401

__version__ = "0.1.0"
