"""Every module of the package imports on its own, first: `import draftsman` loads nothing
heavy (draftsman/__init__.py), so no longer fixes an order on the modules a user imports.
A cycle between two of them (verifier/tree.py and the drafters package once) shows only
when one of them is imported first."""
import json
import subprocess
import sys

# In a fresh interpreter: torch and transformers load once (cycles are among draftsman's own
# modules); before each module, every draftsman module is forgotten, so it is imported first.
_EACH_FIRST = """
import importlib, json, pkgutil, sys
import torch, transformers
import draftsman
names = []
for package in ("draftsman", "draftsman.verifier", "draftsman.drafters", "draftsman.heads", "draftsman.training",
                "draftsman.bench"):
    modules = pkgutil.iter_modules(importlib.import_module(package).__path__)
    names += [package] + [f"{package}.{m.name}" for m in modules if not m.ispkg and m.name != "__main__"]
failed = {}
for name in names:
    for loaded in [m for m in sys.modules if m == "draftsman" or m.startswith("draftsman.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed[name] = str(e)
print(json.dumps([len(names), failed]))
"""


def test_every_module_imports_first():
    out = subprocess.run([sys.executable, "-c", _EACH_FIRST], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert count > 100 and failed == {}
