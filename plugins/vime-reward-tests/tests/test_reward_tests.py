"""The tests reward's parts with exact values (JUnit parsing, the guard, scoring) and, against a real ``local``
sandbox: all-pass mode, the task's num_tests as denominator, a hanging solution, and infrastructure failures —
which raise (the sample is excluded), never score 0."""

from __future__ import annotations

import asyncio

import pytest
from reward_tests_cases import PARTIAL, STUB, TESTS, task_sample
from vime_reward_tests.reward import RewardInfraError, RunOutcome, read_records, record_line, score
from vime_reward_tests.reward import tests_reward as reward_of

from vime_core.data.workspace_task import AgentResult, TaskError, WorkspaceTask, is_guarded, result_files
from vime_core.sandbox.base import SandboxInfraError
from vime_core.sandbox.local import LocalSandbox
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status


def _ctx(**kw):
    return plugin_context(**{"sandbox": "local", "reward_tests_timeout": 60.0, **kw})


@pytest.mark.unit
def test_records_are_authenticated_and_keep_the_worst_outcome_per_test():
    key = b"k" * 32
    lines = [
        "pytest's own output is ignored",
        record_line(key, {"ready": True}),
        record_line(key, {"collected": ["t::a", "t::b", "t::c", "u::a"]}),
        record_line(key, {"id": "t::a", "outcome": "passed"}),
        record_line(key, {"id": "t::b", "outcome": "failed"}),
        record_line(key, {"id": "t::b", "outcome": "error"}),
        record_line(key, {"id": "t::c", "outcome": "skipped"}),
        record_line(key, {"id": "u::a", "outcome": "passed"}),
    ]
    cases, collected, started, complete, tampered = read_records("\n".join(lines), key)
    assert cases == {"t::a": "passed", "t::b": "error", "t::c": "skipped", "u::a": "passed"}
    assert (collected, started, complete, tampered) == (["t::a", "t::b", "t::c", "u::a"], True, False, [])
    end = record_line(key, {"end": True, "tampered": [], "n": 7})
    assert read_records("\n".join(lines + [end]), key)[2:] == (True, True, [])
    forged = record_line(b"x" * 32, {"id": "t::b", "outcome": "passed"})  # written without the key
    cases, _, _, _, tampered = read_records("\n".join(lines + [forged, end]), key)
    assert cases["t::b"] == "error" and tampered == [f"a results line does not authenticate: {forged[:200]!r}"]


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
    assert asyncio.run(reward_of(_ctx(reward_tests_mode="all"), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert (d["passed"], d["total"], d["failed"], d["errors"], d["exit_code"], d["complete"]) == (2, 3, 1, 0, 1, True)
    assert d["cases"] == {
        "test_solution.py::test_small": "passed",
        "test_solution.py::test_zero": "failed",
        "test_solution.py::test_twos": "passed",
    }
    good = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})
    assert asyncio.run(reward_of(_ctx(reward_tests_mode="all"), good)) == 1.0


@pytest.mark.contract
def test_num_tests_is_the_denominator_when_collection_fails():
    # a syntax error: pytest reports one collection error; the task says 3 tests -> 0/3, and 4 declared -> 0/4
    s = task_sample({"solution.py": "def add(a, b) return 1\n"}, num_tests=3)
    assert asyncio.run(reward_of(_ctx(), s)) == 0.0
    assert (s.metadata["reward_tests"]["total"], s.metadata["reward_tests"]["errors"]) == (3, 1)
    s = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"}, num_tests=4)
    assert asyncio.run(reward_of(_ctx(), s)) == 3 / 4


@pytest.mark.contract
def test_a_hanging_solution_scores_zero_at_the_timeout():
    s = task_sample({"solution.py": "import time\ntime.sleep(600)\n"}, num_tests=3, timeout_s=3)
    assert asyncio.run(reward_of(_ctx(), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert (d["timed_out"], d["complete"], d["passed"], d["total"]) == (True, False, 0, 3)


@pytest.mark.contract
def test_missing_python_in_the_sandbox_is_an_infrastructure_failure():
    s = task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})
    with pytest.raises(RewardInfraError, match="pytest cannot run"):
        asyncio.run(reward_of(_ctx(reward_tests_python="/nonexistent/python3"), s))
    assert "reward_tests" not in s.metadata


class BrokenSandbox(LocalSandbox):
    """A local sandbox whose creation fails the way an unreachable daemon does."""

    async def _create(self) -> None:
        raise ConnectionError("sandbox service unreachable")


@pytest.mark.contract
def test_sandbox_failure_excludes_the_sample_instead_of_scoring_zero():
    from vime_core.rollout.runner import GroupRunner

    spec = f"{__name__}:BrokenSandbox"
    with pytest.raises(SandboxInfraError, match="sandbox service unreachable"):
        asyncio.run(reward_of(_ctx(reward_tests_sandbox=spec), task_sample({"solution.py": STUB})))

    # through the rollout manager: the sample is failed, has no reward, and is not trainable
    async def gen(args, sample, sampling_params):
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.1], weight_version=0)
        sample.status = Status.COMPLETED
        return sample

    from vime_core.plugins.manager import get_plugins

    ctx = plugin_context(
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
    runner = GroupRunner(
        ctx, generate_fn=gen, reward_fn=get_plugins().resolve("reward", "tests"), hook=get_plugins().pm.hook
    )
    group = [task_sample({"solution.py": "def add(a, b):\n    return a + b\n"})]
    asyncio.run(runner.run([group], 0))
    (s,) = group
    assert (s.status, s.reward, s.is_trainable()) == (Status.FAILED, None, False)
    assert s.metadata["error"].startswith("SandboxInfraError: ")


@pytest.mark.unit
def test_tests_reach_the_sandbox_only_through_the_reward():
    """The fixture task keeps the hidden tests in metadata.tests, away from metadata.workspace (the agent's)."""
    s: Sample = task_sample(None)
    assert set(s.metadata["workspace"]["files"]) == {"solution.py"} and s.metadata["tests"]["files"] == TESTS


WRONG = "def add(a, b):\n    return -1\n"  # fails all three tests
FAKE_JUNIT = (
    '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3">'
    '<testcase classname="test_solution" name="test_small"/><testcase classname="test_solution" name="test_zero"/>'
    '<testcase classname="test_solution" name="test_twos"/></testsuite></testsuites>'
)
# code under test that tries to forge the results while the hidden tests run
FORGERIES = {
    # writes passing JUnit XML where the old runner read it, now and at exit
    "results_file": (
        "import atexit, os, pathlib\n"
        f"XML = {FAKE_JUNIT!r}\n"
        "def _forge():\n"
        "    for d in ('../.vime-results', '.'):\n"
        "        pathlib.Path(d).mkdir(exist_ok=True)\n"
        "        pathlib.Path(d, 'junit.xml').write_text(XML)\n"
        "_forge()\n"
        "atexit.register(_forge)\n" + WRONG
    ),
    # turns every pytest report into a pass
    "reporter": (
        "import _pytest.reports as r\n"
        "_orig = r.TestReport.from_item_and_call\n"
        "def _forged(cls, item, call):\n"
        "    rep = _orig.__func__(cls, item, call)\n"
        "    rep.outcome, rep.longrepr = 'passed', None\n"
        "    return rep\n"
        "r.TestReport.from_item_and_call = classmethod(_forged)\n" + WRONG
    ),
    # writes pass records into every open descriptor (the results pipe among them), without the key
    "records": (
        "import json, os\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    for t in ('test_small', 'test_zero', 'test_twos'):\n"
        "        body = json.dumps({'id': 'test_solution.py::' + t, 'outcome': 'passed'}, sort_keys=True)\n"
        "        try:\n"
        "            os.write(fd, ('VIME-R ' + '0' * 64 + ' ' + body + chr(10)).encode())\n"
        "        except OSError:\n"
        "            pass\n" + WRONG
    ),
    # ends the test process with status 0 in the middle of the first test
    "early_exit": "import os\ndef add(a, b):\n    os._exit(0)\n",
}


@pytest.mark.contract
@pytest.mark.parametrize("how", sorted(FORGERIES))
def test_code_under_test_cannot_forge_the_results(how):
    s = task_sample({"solution.py": FORGERIES[how]})
    assert asyncio.run(reward_of(_ctx(), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert (d["passed"], d["total"]) == (0, 3)
    ids = [f"test_solution.py::{t}" for t in ("test_small", "test_zero", "test_twos")]
    if how == "early_exit":  # no test finished: no record, the run is incomplete
        assert (d["cases"], d["complete"], d["exit_code"], d["tampered"]) == ({}, False, 0, [])
        return
    assert d["cases"] == dict.fromkeys(ids, "failed") and d["complete"]
    if how == "results_file":
        assert d["tampered"] == []  # the file is simply never read
    elif how == "reporter":
        replaced = "reports.TestReport.from_item_and_call was replaced"
        assert d["tampered"] == [f"{i}: {replaced}" for i in ids] + [replaced]
    else:
        assert len(d["tampered"]) == 3
        assert all(t.startswith("a results line does not authenticate: 'VIME-R 000") for t in d["tampered"])


@pytest.mark.contract
def test_a_correct_solution_that_also_forges_scores_zero():
    """Tampering is scored 0 even when the tests would pass: the run cannot be trusted."""
    s = task_sample({"solution.py": FORGERIES["reporter"].replace(WRONG, "def add(a, b):\n    return a + b\n")})
    assert asyncio.run(reward_of(_ctx(), s)) == 0.0
    d = s.metadata["reward_tests"]
    assert d["cases"] == {f"test_solution.py::{t}": "passed" for t in ("test_small", "test_zero", "test_twos")}
    assert (d["passed"], d["total"], len(d["tampered"])) == (0, 3, 4)
