"""draftsman: exact speculative decoding with pluggable drafters and one shared verifier."""
from ._submodules import submodule_loader as _submodule_loader

__version__ = "0.1.0"

# The public API lives in draftsman.api, which imports torch and transformers (seconds). It loads on
# first use (PEP 562), so `draftsman --help` and an argument error answer at once; so do the
# subpackages and modules (draftsman.config.X after a plain `import draftsman`).
__all__ = ["Decoder", "GenerationOutput", "GenerationStats", "JoiningPrompt", "load"]
_submodule = _submodule_loader(__name__)


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    return _submodule(name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
