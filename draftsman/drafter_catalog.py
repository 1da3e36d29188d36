"""What `draftsman drafters` prints: each registered drafter's name, summary and options.

The built-in drafters are read from their source files with `ast`, without importing them:
importing them imports torch and transformers (4-5 s), and a listing should answer at once.
A drafter the reader cannot follow (an option default that is not a literal, say) sends the
whole listing through the imported classes instead, so the output is the same either way;
tests/test_cli.py checks that it is.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path

# `name: type = default  # help`: the comment after a field is that option's documentation.
_FIELD_COMMENT = re.compile(r"^\s*(\w+)\s*:[^#\n]*#\s*(.+?)\s*$", flags=re.MULTILINE)


def describe_drafters() -> list[dict]:
    """[{name, summary, options: [{name, type, default, help}]}] for every registered drafter, by name."""
    try:
        return read_drafter_sources()
    except (OSError, SyntaxError, TypeError, ValueError):  # a source the reader cannot follow
        return import_drafters()


def read_drafter_sources() -> list[dict]:
    """The listing from the drafters' source files; ValueError where a file holds what it cannot read."""
    folder = Path(importlib.util.find_spec("draftsman.drafters").submodule_search_locations[0])
    out = []
    for module in _registering_modules(folder / "__init__.py"):
        out += _read_module(folder / f"{module}.py")
    return sorted(out, key=lambda d: d["name"])


def import_drafters() -> list[dict]:
    """The listing from the imported drafter classes (the registry's own view)."""
    from .drafters import registry

    out = []
    for name in registry.available():
        cls = registry._REGISTRY[name]
        doc = sys.modules[cls.__module__].__doc__ or cls.__doc__ or ""
        opts_cls = getattr(cls, "Options", None)
        comments = option_comments(opts_cls) if opts_cls else {}
        options = [{"name": f.name, "type": str(f.type),
                    "default": None if f.default is dataclasses.MISSING else f.default,
                    "help": comments.get(f.name, "")} for f in (dataclasses.fields(opts_cls) if opts_cls else [])]
        out.append({"name": name, "summary": _summary(doc, name), "options": options})
    return out


def option_comments(opts_cls) -> dict[str, str]:
    """Each option's same-line `# comment` in an Options class: {} where there is no source (a frozen install)."""
    try:
        return dict(_FIELD_COMMENT.findall(inspect.getsource(opts_cls)))
    except (OSError, TypeError):
        return {}


def _summary(doc: str, name: str) -> str:
    """A docstring's first paragraph on one line, without a leading "`name`:" (the name is printed already)."""
    return " ".join(doc.strip().split("\n\n")[0].split()).removeprefix(f"`{name}`:").strip()


def _registering_modules(init: Path) -> list[str]:
    """The modules drafters/__init__.py imports from its own package: importing them registers the drafters."""
    tree = ast.parse(init.read_text())
    return [alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1
            and node.module is None for alias in node.names]


def _read_module(path: Path) -> list[dict]:
    source = path.read_text()
    tree = ast.parse(source)
    module_doc = ast.get_docstring(tree, clean=False)
    out = []
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and any(isinstance(d, ast.Name) and d.id == "register"
                                                      for d in cls.decorator_list)):
            continue
        name = next((ast.literal_eval(s.value) for s in cls.body if isinstance(s, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "name" for t in s.targets)), None)
        if not isinstance(name, str):
            raise ValueError(f"{path.name}: class {cls.name} is registered without a literal name")
        options_cls = next((s for s in cls.body if isinstance(s, ast.ClassDef) and s.name == "Options"), None)
        if options_cls is not None and options_cls.bases:
            raise ValueError(f"{path.name}: {cls.name}.Options inherits fields")
        doc = module_doc or ast.get_docstring(cls, clean=False) or ""
        options = _read_options(options_cls, source) if options_cls is not None else []
        out.append({"name": name, "summary": _summary(doc, name), "options": options})
    return out


def _read_options(options_cls: ast.ClassDef, source: str) -> list[dict]:
    comments = dict(_FIELD_COMMENT.findall(ast.get_source_segment(source, options_cls, padded=True)))
    options = []
    for field in options_cls.body:
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        default = None if field.value is None else ast.literal_eval(field.value)  # ValueError if not a literal
        options.append({"name": field.target.id, "type": ast.get_source_segment(source, field.annotation),
                        "default": default, "help": comments.get(field.target.id, "")})
    return options
