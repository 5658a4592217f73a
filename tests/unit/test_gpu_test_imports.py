"""The GPU test modules skip at import time without CUDA (``pytest.skip(..., allow_module_level=True)``), so CI never
imports them: a name they import from the project that a refactor renamed would stay unseen until a GPU session
(``_args`` in test_megatron_lr_schedule.py and ``_ppo_args`` in megatron_tp_worker.py, renamed to ``_config`` and
``_ppo_config`` by the config-tree work, failed collection on the H200 on 2026-12-04). Checked here statically: every
``from tests.…``/``vime_core…``/``bench…`` import in ``tests/gpu/`` and ``bench/`` names a module that exists and a
name it defines or imports at its top level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("tests", "vime_core", "bench")


def _module_file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _top_level_names(path: Path, seen: frozenset[Path] = frozenset()) -> set[str]:
    """What ``path`` defines or imports at its top level, following ``from M import *`` into project modules."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            star = _module_file(node.module or "")
            if star is not None and star not in seen:
                names |= _top_level_names(star, seen | {path})
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved_imports(source: str, where: str) -> list[str]:
    """Each ``from PROJECT_MODULE import NAME`` of ``source`` (at any depth) whose module file is missing or does not
    define NAME at its top level (a submodule of a package counts as defined)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT):
            continue
        path = _module_file(node.module)
        if path is None:
            bad.append(f"{where}:{node.lineno}: no module {node.module}")
            continue
        defined = _top_level_names(path)
        for alias in node.names:
            if alias.name not in defined and _module_file(f"{node.module}.{alias.name}") is None:
                bad.append(f"{where}:{node.lineno}: {node.module} has no {alias.name}")
    return bad


def test_the_check_finds_a_renamed_helper():
    source = "def main():\n    from tests.gpu.test_megatron_algorithms import _args, _samples\n"
    assert unresolved_imports(source, "worker.py") == ["worker.py:2: tests.gpu.test_megatron_algorithms has no _args"]
    assert unresolved_imports("from vime_core.nothing_here import x\n", "t.py") == [
        "t.py:1: no module vime_core.nothing_here"
    ]
    # vime_core.sandbox has SandboxLimits only through `from vime_core.sandbox.base import *`
    assert unresolved_imports("from vime_core.sandbox import SandboxLimits\n", "t.py") == []
    assert unresolved_imports("from vime_core.sandbox import NoSuchLimits\n", "t.py") == [
        "t.py:1: vime_core.sandbox has no NoSuchLimits"
    ]


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "tests" / "gpu").glob("*.py"), *(ROOT / "bench").glob("*.py")]), ids=lambda p: p.name
)
def test_gpu_tests_and_benches_import_what_exists(path):
    assert unresolved_imports(path.read_text(), str(path.relative_to(ROOT))) == []
