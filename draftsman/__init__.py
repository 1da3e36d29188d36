"""draftsman: exact speculative decoding with pluggable drafters and one shared verifier."""
__version__ = "0.1.0"

# The public API lives in draftsman.api, which imports torch and transformers (seconds). It is loaded
# on first use (PEP 562), so `draftsman --help` and an argument error answer at once.
__all__ = ["Decoder", "GenerationOutput", "GenerationStats", "JoiningPrompt", "load"]


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'draftsman' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
