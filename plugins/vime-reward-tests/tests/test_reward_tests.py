"""The tests reward's parts with exact values (JUnit parsing, the guard, scoring) and, against a real ``local``
sandbox: all-pass mode, the task's num_tests as denominator, a hanging solution, and infrastructure failures —
which raise (the sample is excluded), never score 0."""

from __future__ import annotations

import argparse
import asyncio
import types

import pytest
from reward_tests_cases import PARTIAL, STUB, TESTS, task_sample
from vime_reward_tests.reward import RewardInfraError, RunOutcome, parse_junit, score
from vime_reward_tests.reward import tests_reward as reward_of

from vime_core.data.workspace_task import AgentResult, TaskError, WorkspaceTask, is_guarded, result_files
from vime_core.sandbox.base import SandboxInfraError
from vime_core.sandbox.local import LocalSandbox
from vime_core.types import Sample, Status

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="t" name="a" time="0.1"/>
<testcase classname="t" name="b" time="0.1"><failure message="x">x</failure></testcase>
<testcase classname="t" name="b" time="0.1"><error message="teardown">y</error></testcase>
<testcase classname="t" name="c" time="0.0"><skipped message="s"/></testcase>
<testcase classname="u" name="a" time="0.1"/>
</testsuite></testsuites>"""


def _args(**kw):
    return argparse.Namespace(**{"sandbox": "local", "reward_tests_timeout": 60.0, **kw})


@pytest.mark.unit
def test_parse_junit_keeps_the_worst_report_per_test():
    assert parse_junit(JUNIT) == {"t::a": "passed", "t::b": "error", "t::c": "skipped", "u::a": "passed"}


@pytest.mark.unit
def test_guard():
    assert [
        is_guarded(p)
        for p in (
            "conftest.py",
            "a/b/conftest.py",
            "test_x.py",
            "pkg/x_test.py",
            "tox.ini",
            "setup.cfg",
            "pytest.ini",
            "sitecustomize.py",
            "evil.pth",
            "_pytest/main.py",
            "pytest.py",
            ".vime-tests/t.py",
        )
    ] == [True] * 12
    assert [is_guarded(p) for p in ("solution.py", "pkg/tests.py", "testing.py", "src/mod.py", "pyproject.toml")] == [
        False
    ] * 5


@pytest.mark.unit
def test_result_files_overlays_changes_and_drops_guarded_ones():
    task = WorkspaceTask(files={"solution.py": "s", "util.py": "u", "test_keep.py": "task's own"})
    res = AgentResult(
        changed={
            "solution.py": "new",
            "util.py": None,
            "extra.py": "e",
            "conftest.py": "c",
            "test_keep.py": "edited",
            "tests/helper.py": "h",
        }
    )
    files, ignored = result_files(task, res, {"tests/test_a.py": "t"})
    assert files == {"solution.py": "new", "extra.py": "e", "test_keep.py": "task's own"}
    assert ignored == ["conftest.py", "test_keep.py", "tests/helper.py"]


@pytest.mark.unit
def test_task_errors_name_the_key():
    with pytest.raises(TaskError, match="metadata.tests.files is missing"):
        WorkspaceTask.from_metadata({"workspace": {"files": {"a.py": ""}}}, need_tests=True)
    with pytest.raises(TaskError, match="relative path"):
        WorkspaceTask.from_metadata({"workspace": {"files": {"../a.py": ""}}})
    with pytest.raises(TaskError, match=r"metadata.workspace.files\['a.py'\] must be a string"):
        WorkspaceTask.from_metadata({"workspace": {"files": {"a.py": 3}}})


@pytest.mark.unit
def test_score_modes():
    o = RunOutcome(passed=2, total=3)
    assert (score(o, "fraction"), score(o, "all")) == (2 / 3, 0.0)
    assert score(RunOutcome(passed=3, total=3), "all") == 1.0
    assert score(RunOutcome(passed=0, total=0), "fraction") == 0.0


@pytest.mark.contract
def test_all_mode_and_details():
    s = task_sample({"solution.py": PARTIAL})
    assert asyncio.run(reward_of(_args(reward_tests_mode="all"), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert (d["passed"], d["total"], d["failed"], d["errors"], d["exit_code"], d["has_xml"]) == (2, 3, 1, 0, 1, True)
    assert d["cases"] == {
        "test_solution::test_small": "passed",
        "test_solution::test_zero": "failed",
        "test_solution::test_twos": "passed",
    }
    good = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})
    assert asyncio.run(reward_of(_args(reward_tests_mode="all"), good)) == 1.0


@pytest.mark.contract
def test_num_tests_is_the_denominator_when_collection_fails():
    # a syntax error: pytest reports one collection error; the task says 3 tests -> 0/3, and 4 declared -> 0/4
    s = task_sample({"solution.py": "def add(a, b) return 1\n"}, num_tests=3)
    assert asyncio.run(reward_of(_args(), s)) == 0.0
    assert (s.metadata["reward_tests"]["total"], s.metadata["reward_tests"]["errors"]) == (3, 1)
    s = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"}, num_tests=4)
    assert asyncio.run(reward_of(_args(), s)) == 3 / 4


@pytest.mark.contract
def test_a_hanging_solution_scores_zero_at_the_timeout():
    s = task_sample({"solution.py": "import time\ntime.sleep(600)\n"}, num_tests=3, timeout_s=3)
    assert asyncio.run(reward_of(_args(), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert (d["timed_out"], d["has_xml"], d["passed"], d["total"]) == (True, False, 0, 3)


@pytest.mark.contract
def test_missing_python_in_the_sandbox_is_an_infrastructure_failure():
    s = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})
    with pytest.raises(RewardInfraError, match="pytest cannot run"):
        asyncio.run(reward_of(_args(reward_tests_python="/nonexistent/python3"), s))
    assert "reward_tests" not in s.metadata


class BrokenSandbox(LocalSandbox):
    """A local sandbox whose creation fails the way an unreachable daemon does."""

    async def _create(self) -> None:
        raise ConnectionError("sandbox service unreachable")


@pytest.mark.contract
def test_sandbox_failure_excludes_the_sample_instead_of_scoring_zero():
    from vime_core.rollout.manager import _run_groups

    spec = f"{__name__}:BrokenSandbox"
    with pytest.raises(SandboxInfraError, match="sandbox service unreachable"):
        asyncio.run(reward_of(_args(reward_tests_sandbox=spec), task_sample({"solution.py": STUB})))

    # through the rollout manager: the sample is failed, has no reward, and is not trainable
    async def gen(args, sample, sampling_params):
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.1], weight_version=0)
        sample.status = Status.COMPLETED
        return sample

    from vime_core.plugins import get_plugins

    args = argparse.Namespace(
        sandbox="local",
        reward_tests_sandbox=spec,
        rollout_concurrency=2,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=8,
        rollout_stop=None,
        rollout_stop_token_ids=None,
    )
    mgr = types.SimpleNamespace(
        args=args,
        generate_fn=gen,
        reward_fn=get_plugins().resolve("reward", "tests"),
        hook=get_plugins().pm.hook,
        teacher=None,
        aborting=False,
        weight_version=0,
    )
    group = [task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})]
    asyncio.run(_run_groups(mgr, [group], 0))
    (s,) = group
    assert (s.status, s.reward, s.is_trainable()) == (Status.FAILED, None, False)
    assert s.metadata["error"].startswith("SandboxInfraError: ")


@pytest.mark.unit
def test_tests_reach_the_sandbox_only_through_the_reward():
    """The fixture task keeps the hidden tests in metadata.tests, away from metadata.workspace (the agent's)."""
    s: Sample = task_sample(None)
    assert set(s.metadata["workspace"]["files"]) == {"solution.py"} and s.metadata["tests"]["files"] == TESTS
