"""A package's module __getattr__ (PEP 562) that imports its submodule `name` on first use.

`import draftsman` loads nothing heavy; the packages import their modules when asked, so a
script's draftsman.config.load_config or draftsman.verifier.sampling.SamplingParams, after a
plain `import draftsman`, works as it did when draftsman imported its whole API up front."""
from __future__ import annotations

import importlib
import importlib.util


def submodule_loader(package: str):
    def __getattr__(name: str):
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
