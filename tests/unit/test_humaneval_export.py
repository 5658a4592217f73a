"""HumanEval as workspace tasks: the exported tests pass HumanEval's canonical solution and fail the stub on every
one of the 164 problems (executed in-process here, exactly the generated code; through pytest in a real sandbox in
plugins/vime-reward-tests/tests/test_reward_tests_humaneval.py)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from vime_core.data.humaneval_export import build_tests, export_humaneval, load_problems, problem_to_row
from vime_core.data.workspace_task import WorkspaceTask

pytestmark = pytest.mark.unit


def _run(solution: str, tests: str) -> list[int]:
    """1/0 per test function of ``tests`` with ``solution`` importable as ``solution``."""
    mod = types.ModuleType("solution")
    old = sys.modules.get("solution")
    sys.modules["solution"] = mod
    try:
        exec(compile(solution, "solution.py", "exec"), mod.__dict__)
        ns: dict = {}
        exec(compile(tests, "test_solution.py", "exec"), ns)
        out = []
        for name, fn in ns.items():
            if name.startswith("test_"):
                try:
                    fn()
                    out.append(1)
                except Exception:  # noqa: BLE001 - a failing test
                    out.append(0)
        return out
    finally:
        if old is None:
            sys.modules.pop("solution", None)
        else:
            sys.modules["solution"] = old


def test_every_problem_canonical_passes_all_stub_passes_none():
    problems = load_problems()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    total = 0
    for p in problems:
        meta = problem_to_row(p, include_solution=True)["metadata"]
        tests, n = meta["tests"]["files"]["test_solution.py"], meta["tests"]["num_tests"]
        assert _run(meta["canonical_solution"], tests) == [1] * n, p["task_id"]
        assert _run(meta["workspace"]["files"]["solution.py"], tests) == [0] * n, p["task_id"]
        total += n
    assert total == 1133  # HumanEval's checks that assert something about the candidate


def test_humaneval_0_row_exactly():
    p = load_problems()[0]
    row = problem_to_row(p)
    task = WorkspaceTask.from_metadata(row["metadata"], need_tests=True)
    assert task.files == {"solution.py": p["prompt"] + "    raise NotImplementedError\n"}
    assert task.num_tests == 7 and "canonical_solution" not in row["metadata"]
    assert row["prompt"].startswith("The file `solution.py` in the current directory defines `has_close_elements`")
    assert p["prompt"] in row["prompt"]
    tests = task.tests["test_solution.py"]
    assert tests.count("\ndef test_check_") == 7
    assert (
        "def test_check_00():\n    candidate = has_close_elements\n    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2]"
        in tests
    )
    # `return True` passes exactly the checks whose expected value is True
    assert _run(p["prompt"] + "    return True\n", tests) == [1, 0, 1, 0, 1, 1, 0]


def test_split_rule():
    code = (
        "def check(candidate):\n    import math\n    assert True, 'placeholder'\n    assert candidate(1) == 2\n"
        "    x = 3\n    for i in range(2):\n        assert candidate(i) == i + 1\n"
    )
    src, n = build_tests(code, "f", "T/1")
    assert n == 2
    assert "def test_check_00():\n    candidate = f\n    import math\n    assert candidate(1) == 2\n" in src
    assert "def test_check_01():\n    candidate = f\n    import math\n    x = 3\n    for i in range(2):\n" in src
    assert "placeholder" not in src
    with pytest.raises(ValueError, match="no check"):
        build_tests("x = 1\n", "f", "T/2")


def test_export_cli_writes_jsonl(tmp_path):
    from vime_core.cli.commands import main

    out = tmp_path / "he.jsonl"
    assert main(["data", "humaneval", "--out", str(out), "--task-ids", "HumanEval/3", "HumanEval/0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["metadata"]["task_id"] for r in rows] == ["HumanEval/3", "HumanEval/0"]
    assert export_humaneval(tmp_path / "b.jsonl", limit=5).read_text().count("\n") == 5
    with pytest.raises(KeyError, match="HumanEval/999"):
        export_humaneval(tmp_path / "c.jsonl", task_ids=["HumanEval/999"])
