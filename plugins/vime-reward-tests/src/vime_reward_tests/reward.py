"""The ``tests`` reward: run a workspace task's hidden tests against the agent's result in a **fresh** sandbox.

For one sample (see :mod:`vime_core.data.workspace_task` for the row format):

1. The workspace as the agent left it is rebuilt on the host: the task's files (``metadata["workspace"]``) plus the
   agent's changes (``metadata["agent_result"]``, written by the ``coding_agent`` generate function). Agent files
   that could change the test run are dropped and listed in ``metadata["reward_tests"]["ignored"]``: test modules,
   ``conftest.py``, pytest/tox/setup.cfg configuration, ``sitecustomize.py``/``*.pth``, modules shadowing pytest,
   anything at a hidden test's path or in its top-level directory (:func:`vime_core.data.workspace_task.is_guarded`).
2. A new sandbox of ``--reward-tests-sandbox`` (default: the run's ``--sandbox``) is created. One archive is unpacked
   in its workspace: ``code/`` (the rebuilt workspace), ``.vime-tests/`` (the task's hidden tests, which the agent
   never saw), ``.vime-cfg/pytest.ini`` (an empty configuration) and ``.vime-pytest/`` (the host's own pure-Python
   pytest, pluggy, iniconfig, packaging and pygments, shipped as one cached gzip archive: the sandbox needs only
   ``python3``, ``tar`` and ``gzip``).
3. A preflight imports that pytest in the sandbox. It failing is an infrastructure failure (no agent code has run
   yet): :class:`RewardInfraError`.
4. pytest runs with ``cwd=code/``, ``python3 -I`` (no environment variables, user site or current directory on the
   path), the code directory **last** on ``sys.path``, ``-c .vime-cfg/pytest.ini --rootdir/--confcutdir
   .vime-tests`` (no configuration or conftest from the agent's tree), plugin autoloading off, no cache, and
   ``--junitxml`` outside ``code/``; the run is killed after the timeout.
5. The JUnit XML is parsed: a test passes if none of its reports failed, errored or was skipped. ``passed / total``
   (``--reward-tests-mode fraction``, default) or ``1.0`` iff all passed (``all``); ``total`` is the task's
   ``num_tests`` when given (a collection error or a crash then counts every missing test as failed), else the
   number of tests reported. No XML (the run crashed or timed out) means nothing passed.

Infrastructure failures — the sandbox cannot be created or dies (:class:`vime_core.sandbox.SandboxError`), the
preflight fails — **raise**: the rollout manager marks the sample ``failed`` and excludes it; it is never scored 0.
A malformed task row raises :class:`vime_core.data.workspace_task.TaskError` (the sample fails, naming the key).

Limits: the agent's code runs inside the test process, so code that tampers with pytest from within (monkeypatching
its reporting) is not prevented; what is prevented is every file-level way to change the tests or their
configuration.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import logging
import shlex
import tarfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vime_core.data.workspace_task import AgentResult, WorkspaceTask, result_files
from vime_core.types import Sample

logger = logging.getLogger("vime.reward.tests")

#: Host modules shipped into the sandbox as its pytest (pure Python; the optional ones when installed).
PYTEST_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments")
PYTEST_OPTIONAL_MODULES = ("exceptiongroup", "tomli")

CODE_DIR, TESTS_DIR, CFG_DIR = "code", ".vime-tests", ".vime-cfg"
PYTEST_DIR, RESULTS_DIR = ".vime-pytest", ".vime-results"

# Runs in the sandbox as `python3 -I -c RUNNER WORKSPACE`.
RUNNER = """
import sys
ws = sys.argv[1]
sys.path.insert(0, ws + "/.vime-pytest")
sys.path.append(ws + "/code")
import pytest
sys.exit(pytest.main([
    ws + "/.vime-tests", "-c", ws + "/.vime-cfg/pytest.ini", "--rootdir", ws + "/.vime-tests",
    "--confcutdir", ws + "/.vime-tests", "-p", "no:cacheprovider", "--junitxml", ws + "/.vime-results/junit.xml",
    "-o", "junit_family=xunit2", "-q", "--color=no", "-W", "ignore::DeprecationWarning",
]))
"""
PREFLIGHT = "import sys; sys.path.insert(0, sys.argv[1]); import pytest; print('VIME-PYTEST-OK', pytest.__version__)"


class RewardInfraError(RuntimeError):
    """The test run could not be set up (not the agent's doing): the sample is marked failed and excluded, counted
    as ``rollout/failed/sandbox_error`` (:mod:`vime_core.failures`)."""

    failure_cause = "sandbox_error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--reward-tests-*`` flags."""
    g = parser.add_argument_group("vime-reward-tests (--reward tests)")
    g.add_argument(
        "--reward-tests-mode",
        choices=["fraction", "all"],
        default="fraction",
        help="fraction: passed/total tests; all: 1.0 iff every test passed, else 0.0",
    )
    g.add_argument(
        "--reward-tests-timeout",
        type=float,
        default=120.0,
        help="seconds for one test run (a task's tests.timeout_s wins); killed at the limit, tests without a "
        "result count as failed",
    )
    g.add_argument(
        "--reward-tests-sandbox",
        default=None,
        help="sandbox backend for the test run (default: --sandbox); always a fresh sandbox per sample",
    )
    g.add_argument("--reward-tests-python", default="python3", help="Python interpreter inside the sandbox")


def _opt(args: Any, name: str, default: Any) -> Any:
    v = getattr(args, name, None)
    return default if v is None else v


@dataclass
class RunOutcome:
    """One test run's result (also stored as ``sample.metadata["reward_tests"]``).

    :ivar passed: tests that passed. :ivar total: the denominator (task ``num_tests`` or tests reported).
    :ivar failed: tests with a failure. :ivar errors: tests with an error (collection, setup, teardown).
    :ivar skipped: tests skipped or xfailed. :ivar exit_code: pytest's exit code (137 when killed).
    :ivar timed_out: killed at the timeout. :ivar has_xml: the JUnit XML was written.
    :ivar ignored: agent paths dropped by the guard. :ivar output_tail: the end of pytest's output.
    :ivar cases: test id → ``passed|failed|error|skipped``.
    """

    passed: int = 0
    total: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    has_xml: bool = False
    ignored: list[str] = field(default_factory=list)
    output_tail: str = ""
    seconds: float = 0.0
    cases: dict[str, str] = field(default_factory=dict)


def parse_junit(xml_text: str) -> dict[str, str]:
    """Test id (``classname::name``) → outcome from pytest's JUnit XML.

    A test reported several times (a call failure plus a teardown error) keeps its worst outcome:
    ``error`` > ``failed`` > ``skipped`` > ``passed``.

    :raises ET.ParseError: not XML.
    """
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    out: dict[str, str] = {}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        outcome = next(
            (o for t, o in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")) if t in tags), "passed"
        )
        if tid not in out or rank[outcome] > rank[out[tid]]:
            out[tid] = outcome
    return out


@functools.lru_cache(maxsize=1)
def pytest_bundle() -> bytes:
    """A gzip tar of the host's pytest and its pure-Python dependencies (paths relative to ``.vime-pytest/``),
    built once per process.

    :raises RewardInfraError: a required module is not installed on the host.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name in PYTEST_MODULES + PYTEST_OPTIONAL_MODULES:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None:
                if name in PYTEST_OPTIONAL_MODULES:
                    continue
                raise RewardInfraError(f"the tests reward ships the host's {name!r} into the sandbox; not installed")
            origin = Path(spec.origin)
            if spec.submodule_search_locations:  # a package: every file except bytecode caches
                root = origin.parent
                paths = [(p, f"{name}/{p.relative_to(root).as_posix()}") for p in sorted(root.rglob("*"))]
            else:
                paths = [(origin, origin.name)]
            for p, arc in paths:
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                    _add(tar, arc, p.read_bytes())
    return buf.getvalue()


def _add(tar: tarfile.TarFile, path: str, data: bytes) -> None:
    info = tarfile.TarInfo(path)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def build_archive(files: dict[str, str], tests: dict[str, str]) -> bytes:
    """The tar unpacked into the sandbox workspace (``code/``, ``.vime-tests/``, ``.vime-cfg/``, ``.vime-pytest/``
    (empty: :func:`pytest_bundle` goes there), ``.vime-results/``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in (CODE_DIR, TESTS_DIR, CFG_DIR, PYTEST_DIR, RESULTS_DIR):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o777
            tar.addfile(info)
        for path, text in sorted(files.items()):
            _add(tar, f"{CODE_DIR}/{path}", text.encode())
        for path, text in sorted(tests.items()):
            _add(tar, f"{TESTS_DIR}/{path}", text.encode())
        _add(tar, f"{CFG_DIR}/pytest.ini", b"[pytest]\n")
    return buf.getvalue()


def score(outcome: RunOutcome, mode: str) -> float:
    """The reward of an outcome: ``passed/total`` (``fraction``) or all-pass (``all``); 0.0 when ``total`` is 0."""
    if outcome.total <= 0:
        return 0.0
    if mode == "all":
        return 1.0 if outcome.passed == outcome.total else 0.0
    return outcome.passed / outcome.total


async def run_tests(
    args: Any, task: WorkspaceTask, files: dict[str, str], *, timeout_s: float, python: str = "python3"
) -> RunOutcome:
    """Run ``task.tests`` against ``files`` in a fresh sandbox (see the module docstring).

    :raises RewardInfraError: the preflight failed or the runner's output is unreadable.
    :raises vime_core.sandbox.SandboxError: the sandbox failed.
    """
    from vime_core.plugins import get_plugins

    backend = _opt(args, "reward_tests_sandbox", None) or _opt(args, "sandbox", None) or "local"
    cls = get_plugins().resolve("sandbox", backend)
    archive = build_archive(files, task.tests)
    b = uuid.uuid4().hex  # section boundary of the runner's report
    script = (
        f'ws="$1"; cd "$ws/{CODE_DIR}" || exit 90; '
        f'pre=$({python} -I -c {shlex.quote(PREFLIGHT)} "$ws/{PYTEST_DIR}" 2>&1) || '
        f'{{ echo "VIME-PREFLIGHT-FAILED {b}"; echo "$pre"; exit 0; }}; echo "$pre"; '
        f"PYTHONDONTWRITEBYTECODE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s KILL {timeout_s:.3f} "
        f'{python} -I -c {shlex.quote(RUNNER)} "$ws" > "$ws/{RESULTS_DIR}/out.txt" 2>&1 < /dev/null; '
        f'echo "VIME-RC {b} $?"; tail -c 4000 "$ws/{RESULTS_DIR}/out.txt"; echo "VIME-XML {b}"; '
        f'cat "$ws/{RESULTS_DIR}/junit.xml" 2>/dev/null; true'
    )
    t0 = time.monotonic()
    async with cls.from_args(args) as sb:
        up = await sb.exec(
            ["/bin/sh", "-c", 'mkdir -p -- "$1" && tar -x -f - -C "$1"', "sh", sb.workspace],
            stdin=archive,
            timeout=120.0,
        )
        if not up.ok:
            raise RewardInfraError(f"{backend} sandbox: unpacking the test workspace failed: {up.stderr[-500:]}")
        up = await sb.exec(
            ["/bin/sh", "-c", 'tar -x -z -f - -C "$1"', "sh", f"{sb.workspace}/{PYTEST_DIR}"],
            stdin=pytest_bundle(),
            timeout=120.0,
        )
        if not up.ok:
            raise RewardInfraError(
                f"{backend} sandbox: unpacking pytest failed (tar, gzip needed): {up.stderr[-500:]}"
            )
        res = await sb.exec(
            ["/bin/sh", "-c", script, "sh", sb.workspace], timeout=timeout_s + 60.0, max_output_bytes=16 << 20
        )
    out = RunOutcome(seconds=time.monotonic() - t0)
    text = res.stdout
    if f"VIME-PREFLIGHT-FAILED {b}" in text or "VIME-PYTEST-OK" not in text.split(f"VIME-RC {b}")[0]:
        raise RewardInfraError(
            f"{backend} sandbox: pytest cannot run with {python!r} (exit {res.exit_code}): "
            f"{(text + res.stderr)[-800:]}"
        )
    marker = f"VIME-RC {b} "
    if marker not in text or f"VIME-XML {b}" not in text:
        raise RewardInfraError(f"{backend} sandbox: the test runner's report is incomplete: {text[-500:]!r}")
    rest = text.split(marker, 1)[1]
    rc_line, _, rest = rest.partition("\n")
    tail, _, xml_text = rest.partition(f"VIME-XML {b}\n")
    out.exit_code = int(rc_line.strip())
    out.timed_out = out.exit_code == 137
    out.output_tail = tail[-2000:]
    if xml_text.strip():
        try:
            out.cases = parse_junit(xml_text)
            out.has_xml = True
        except ET.ParseError as e:  # written by a killed or tampered run: nothing counts as passed
            logger.warning("tests reward: unreadable JUnit XML (%s)", e)
    values = list(out.cases.values())
    out.passed, out.failed = values.count("passed"), values.count("failed")
    out.errors, out.skipped = values.count("error"), values.count("skipped")
    out.total = max(task.num_tests or 0, len(values))
    return out


async def tests_reward(args: argparse.Namespace, sample: Sample) -> float:
    """Reward from the task's hidden tests (see the module docstring); details in ``metadata["reward_tests"]``.

    :return: the pass fraction (``--reward-tests-mode fraction``) or 1.0/0.0 (``all``).
    :raises vime_core.data.workspace_task.TaskError: the row has no hidden tests or is malformed.
    :raises RewardInfraError: the test run could not be set up (the sample is excluded, not scored 0).
    :raises vime_core.sandbox.SandboxError: the sandbox failed (likewise).
    """
    task = WorkspaceTask.from_metadata(sample.metadata, need_tests=True)
    result = AgentResult.from_metadata(sample.metadata)
    files, ignored = result_files(task, result, task.tests)
    timeout_s = float(task.timeout_s or _opt(args, "reward_tests_timeout", 120.0))
    python = _opt(args, "reward_tests_python", "python3")
    outcome = await run_tests(args, task, files, timeout_s=timeout_s, python=python)
    outcome.ignored = ignored
    sample.metadata["reward_tests"] = asdict(outcome)
    return score(outcome, _opt(args, "reward_tests_mode", "fraction"))
