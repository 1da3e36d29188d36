"""The wheel installs everything under `draftsman/` and nothing else at the top level.

The role folders (drafters/, verifier/, heads/, training/) sit at the repo root but are mapped
into the draftsman namespace by pyproject.toml; a top-level `drafters` package would clash with an
unrelated one on PyPI. The wheel is built from a fresh copy of the sources, so stale files in a
local build/ folder cannot hide a packaging gap.
"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLE_FOLDERS = ["drafters", "verifier", "heads", "training"]
SOURCES = ["pyproject.toml", "README.md", "draftsman", *ROLE_FOLDERS]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--quiet", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("draftsman-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_role_folders_install_under_draftsman(wheel):
    names = set(wheel.namelist())
    for folder in ROLE_FOLDERS:
        for py in sorted((ROOT / folder).rglob("*.py")):
            rel = py.relative_to(ROOT / folder).as_posix()
            assert f"draftsman/{folder}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    for py in sorted((ROOT / "draftsman").rglob("*.py")):
        assert f"draftsman/{py.relative_to(ROOT / 'draftsman').as_posix()}" in names
    assert "draftsman/cli.py" in names and "draftsman/__main__.py" in names


def test_config_files_are_packaged(wheel):
    names = set(wheel.namelist())
    for yaml_file in sorted((ROOT / "training" / "configs").glob("*.yaml")):
        assert f"draftsman/training/configs/{yaml_file.name}" in names
    for yaml_file in sorted((ROOT / "draftsman" / "configs").glob("*.yaml")):
        assert f"draftsman/configs/{yaml_file.name}" in names
    # `draftsman compare` reads its bundled prompt set from the installed package.
    assert "draftsman/bench/data/prompts.jsonl" in names


def test_nothing_else_at_the_top_level(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"draftsman"}, f"unexpected top-level entries: {sorted(tops - dist_info - {'draftsman'})}"
    (info,) = dist_info
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["draftsman"]


def test_console_script_entry_point(wheel):
    (info,) = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" in n}
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "[console_scripts]" in entry_points
    assert "draftsman = draftsman.cli:main" in entry_points


def test_the_unpacked_wheel_imports_on_its_own(wheel, tmp_path):
    """The cross-folder relative imports (draftsman.drafters -> ..verifier) hold in the installed layout."""
    wheel.extractall(tmp_path)
    code = ("import draftsman, draftsman.cli, draftsman.drafters, draftsman.verifier.engine, draftsman.heads;"
            "print(draftsman.__file__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(tmp_path), proc.stdout
