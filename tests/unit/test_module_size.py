"""vime_core's modules stay small enough to hold one concept: a module over :data:`MAX_LINES` lines fails unless
:data:`ALLOWED` lists it with the one concept it holds (a module that holds several is split instead, as
``sandbox/base.py`` and ``arguments.py`` were); no function is longer than :data:`MAX_FUNCTION_LINES` lines."""

import ast
from pathlib import Path

import pytest

import vime_core

pytestmark = pytest.mark.unit

MAX_LINES = 600
MAX_FUNCTION_LINES = 100
ROOT = Path(vime_core.__file__).parent

#: module (relative to vime_core/) → the one concept that makes it long
ALLOWED: dict[str, str] = {
    "sandbox/local.py": "the local backend: one Sandbox subclass, its namespace and process-group modes",
}


def _lengths() -> dict[str, int]:
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in sorted(ROOT.rglob("*.py"))}


def test_no_module_over_the_limit_unless_allowed():
    long = {m: n for m, n in _lengths().items() if n > MAX_LINES and m not in ALLOWED}
    assert not long, (
        f"modules over {MAX_LINES} lines: {long}; split each into one-concept modules, or add it to ALLOWED "
        "with the one concept it holds"
    )


def test_the_allow_list_is_current():
    lengths = _lengths()
    stale = sorted(m for m in ALLOWED if lengths.get(m, 0) <= MAX_LINES)
    assert not stale, f"ALLOWED lists modules that are gone or no longer over {MAX_LINES} lines: {stale}"
    assert all(reason.strip() and "\n" not in reason for reason in ALLOWED.values())


def test_no_function_over_the_limit():
    """Every function (and method) of vime_core, from its ``def`` line to its last line, fits in
    :data:`MAX_FUNCTION_LINES` lines: a longer one is split into named steps (issue 36)."""
    long = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"
