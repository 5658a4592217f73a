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
   .vime-tests`` (no configuration or conftest from the agent's tree), plugin autoloading off, no cache, and vime's
   verdict plugin (:mod:`vime_reward_tests.verdict_plugin`, loaded before any test module); the run is killed after
   the timeout.
5. **The results channel is out of the tested code's reach**: no results file is read. The verdict plugin decides
   each test from the exceptions its setup, call and teardown raised (not from pytest's reports), checks after every
   test that nothing it depends on was replaced, and sends one HMAC-authenticated record per test over a pipe
   (file descriptor 3 → the harness) with a key the harness sends on stdin before any agent code runs. A record
   that does not authenticate, or a detected change to pytest's machinery, makes the run ``tampered``: score 0. A
   test passes if its record says so; ``passed / total`` (``--reward-tests-mode fraction``, default) or ``1.0`` iff
   all passed (``all``); ``total`` is the task's ``num_tests`` when given (a collection error or a crash then counts
   every missing test as failed), else the number of tests collected or reported. A run that ends early (crash,
   ``os._exit``, timeout) counts only the tests whose records arrived.

Infrastructure failures — the sandbox cannot be created or dies (:class:`vime_core.sandbox.SandboxError`), the
preflight fails — **raise**: the rollout manager marks the sample ``failed`` and excludes it; it is never scored 0.
A malformed task row raises :class:`vime_core.data.workspace_task.TaskError` (the sample fails, naming the key).

Limits: the agent's code runs inside the test process. Writing result files, patching pytest's reports, runner or
hooks, registering plugins, tracing, and exiting early cannot raise the score; code that targets the verdict plugin
itself (reading its key from memory, rewriting its code objects, ``ctypes``) is not prevented.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.util
import io
import json
import logging
import secrets
import shlex
import tarfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vime_core.config import PluginConfig, flag
from vime_core.config.context import PluginContext, takes_context
from vime_core.data.workspace_task import AgentResult, WorkspaceTask, result_files
from vime_core.types import Sample

logger = logging.getLogger("vime.reward.tests")

#: Host modules shipped into the sandbox as its pytest (pure Python; the optional ones when installed).
PYTEST_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments")
PYTEST_OPTIONAL_MODULES = ("exceptiongroup", "tomli")

CODE_DIR, TESTS_DIR, CFG_DIR = "code", ".vime-tests", ".vime-cfg"
PYTEST_DIR, RESULTS_DIR = ".vime-pytest", ".vime-results"
VERDICT_MODULE = "vime_verdict"  # verdict_plugin.py's name in the sandbox
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}

# Runs in the sandbox as `python3 -I -c RUNNER WORKSPACE`.
RUNNER = """
import sys
ws = sys.argv[1]
sys.path.insert(0, ws + "/.vime-pytest")
sys.path.append(ws + "/code")
import pytest
sys.exit(pytest.main([
    ws + "/.vime-tests", "-c", ws + "/.vime-cfg/pytest.ini", "--rootdir", ws + "/.vime-tests",
    "--confcutdir", ws + "/.vime-tests", "-p", "no:cacheprovider", "-p", "vime_verdict",
    "-q", "--color=no", "-W", "ignore::DeprecationWarning",
]))
"""
PREFLIGHT = "import sys; sys.path.insert(0, sys.argv[1]); import pytest; print('VIME-PYTEST-OK', pytest.__version__)"


class RewardInfraError(RuntimeError):
    """The test run could not be set up (not the agent's doing): the sample is marked failed and excluded, counted
    as ``rollout/failed/sandbox_error`` (:mod:`vime_core.failures`)."""

    failure_cause = "sandbox_error"


@dataclass(frozen=True, kw_only=True)
class RewardTestsFlags(PluginConfig):
    """The ``--reward-tests-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "reward-tests"
    TITLE = "vime-reward-tests (--reward tests)"

    reward_tests_mode: str = flag(
        choices=["fraction", "all"],
        default="fraction",
        help="fraction: passed/total tests; all: 1.0 iff every test passed, else 0.0",
    )
    reward_tests_timeout: float = flag(
        type=float,
        default=120.0,
        help="seconds for one test run (a task's tests.timeout_s wins); killed at the limit, tests without a "
        "result count as failed",
    )
    reward_tests_sandbox: str | None = flag(
        default=None, help="sandbox backend for the test run (default: --sandbox); always a fresh sandbox per sample"
    )
    reward_tests_python: str = flag(default="python3", help="Python interpreter inside the sandbox")


@dataclass
class RunOutcome:
    """One test run's result (also stored as ``sample.metadata["reward_tests"]``).

    :ivar passed: tests that passed. :ivar total: the denominator (task ``num_tests`` or tests reported).
    :ivar failed: tests with a failure. :ivar errors: tests with an error (collection, setup, teardown).
    :ivar skipped: tests skipped or xfailed. :ivar exit_code: pytest's exit code (137 when killed).
    :ivar timed_out: killed at the timeout. :ivar complete: the verdict plugin's final record arrived (the run was
        not cut short). :ivar tampered: why the run is scored 0 despite its records (a record that does not
        authenticate, a replaced part of pytest), empty if nothing was found.
    :ivar ignored: agent paths dropped by the guard. :ivar output_tail: the end of pytest's output (untrusted).
    :ivar cases: test id → ``passed|failed|error|skipped``.
    """

    passed: int = 0
    total: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    complete: bool = False
    tampered: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    output_tail: str = ""
    seconds: float = 0.0
    cases: dict[str, str] = field(default_factory=dict)


def record_line(key: bytes, record: dict[str, Any]) -> str:
    """One results line as the verdict plugin writes it: ``VIME-R <hmac-sha256 hex> <json>``."""
    body = json.dumps(record, sort_keys=True)
    return f"VIME-R {hmac.new(key, body.encode(), hashlib.sha256).hexdigest()} {body}"


def read_records(text: str, key: bytes) -> tuple[dict[str, str], list[str], bool, list[str]]:
    """Authenticate and merge the verdict plugin's lines in ``text`` (other lines are ignored).

    A test reported several times keeps its worst outcome: ``error`` > ``failed`` > ``skipped`` > ``passed``.

    :return: ``(cases, collected, started, complete, tampered)``: test id → outcome; the ids pytest collected;
        whether the plugin started (its first record, written before any agent code runs) and whether its final
        record arrived; reasons to score the run 0 (lines that do not authenticate, what the plugin found replaced).
    """
    cases: dict[str, str] = {}
    collected: list[str] = []
    started, complete, tampered = False, False, []
    for line in text.splitlines():
        if not line.startswith("VIME-R "):
            continue
        _, mac, body = (line.split(" ", 2) + ["", ""])[:3]
        good = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, good):
            tampered.append(f"a results line does not authenticate: {line[:200]!r}")
            continue
        record = json.loads(body)
        if record.get("ready"):
            started = True
        elif record.get("end"):
            complete = True
            tampered += [str(t) for t in record.get("tampered", [])]
        elif "collected" in record:
            collected = [str(i) for i in record["collected"]]
        else:
            tid, outcome = str(record["id"]), str(record["outcome"])
            if tid not in cases or RANK[outcome] > RANK[cases[tid]]:
                cases[tid] = outcome
    return cases, collected, started, complete, tampered


@functools.lru_cache(maxsize=1)
def pytest_bundle() -> bytes:
    """A gzip tar of the host's pytest and its pure-Python dependencies, and vime's verdict plugin as
    ``vime_verdict.py`` (paths relative to ``.vime-pytest/``), built once per process.

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
        _add(tar, f"{VERDICT_MODULE}.py", (Path(__file__).parent / "verdict_plugin.py").read_bytes())
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
    ctx: PluginContext, task: WorkspaceTask, files: dict[str, str], *, timeout_s: float, python: str
) -> RunOutcome:
    """Run ``task.tests`` against ``files`` in a fresh sandbox (see the module docstring).

    :raises RewardInfraError: the preflight failed or the runner's output is unreadable.
    :raises vime_core.sandbox.SandboxError: the sandbox failed.
    """
    from vime_core.plugins.manager import get_plugins

    backend = ctx.plugin(RewardTestsFlags).reward_tests_sandbox or ctx.sandbox.sandbox
    cls = get_plugins().resolve("sandbox", backend)
    archive = build_archive(files, task.tests)
    b = uuid.uuid4().hex  # section boundary of the runner's report
    key = secrets.token_hex(32)  # the verdict plugin's HMAC key: on stdin only, never in the command or a file
    # pytest's stdin is this command's stdin (the key); its fd 3 is this command's stdout (the results pipe); its own
    # stdout/stderr go to a file (shown as an untrusted tail)
    script = (
        f'ws="$1"; cd "$ws/{CODE_DIR}" || exit 90; '
        f'pre=$({python} -I -c {shlex.quote(PREFLIGHT)} "$ws/{PYTEST_DIR}" 2>&1 < /dev/null) || '
        f'{{ echo "VIME-PREFLIGHT-FAILED {b}"; echo "$pre"; exit 0; }}; echo "$pre"; echo "VIME-RECORDS {b}"; '
        f"PYTHONDONTWRITEBYTECODE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s KILL {timeout_s:.3f} "
        f'{python} -I -c {shlex.quote(RUNNER)} "$ws" 3>&1 > "$ws/{RESULTS_DIR}/out.txt" 2>&1; '
        f'echo "VIME-RC {b} $?"; echo "VIME-TAIL {b}"; tail -c 4000 "$ws/{RESULTS_DIR}/out.txt"; true'
    )
    t0 = time.monotonic()
    async with cls.from_context(ctx) as sb:
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
            ["/bin/sh", "-c", script, "sh", sb.workspace],
            stdin=(key + "\n").encode(),
            timeout=timeout_s + 60.0,
            max_output_bytes=16 << 20,
        )
    out = RunOutcome(seconds=time.monotonic() - t0)
    text = res.stdout
    if f"VIME-PREFLIGHT-FAILED {b}" in text or "VIME-PYTEST-OK" not in text.split(f"VIME-RC {b}")[0]:
        raise RewardInfraError(
            f"{backend} sandbox: pytest cannot run with {python!r} (exit {res.exit_code}): "
            f"{(text + res.stderr)[-800:]}"
        )
    marker = f"VIME-RC {b} "
    if f"VIME-RECORDS {b}" not in text or marker not in text or f"VIME-TAIL {b}" not in text:
        raise RewardInfraError(f"{backend} sandbox: the test runner's report is incomplete: {text[-500:]!r}")
    records = text.split(f"VIME-RECORDS {b}\n", 1)[1].rsplit(f"VIME-TAIL {b}", 1)[0]
    records, _, rc_line = records.rpartition(marker)  # the shell's line comes after everything pytest wrote
    out.exit_code = int(rc_line.strip().split()[0]) if rc_line.strip() else None
    out.timed_out = out.exit_code == 137
    out.output_tail = text.rsplit(f"VIME-TAIL {b}\n", 1)[1][-2000:]
    cases, collected, started, out.complete, out.tampered = read_records(records, key.encode())
    if not started:  # no agent code had run yet: not the agent's doing
        raise RewardInfraError(
            f"{backend} sandbox: vime's verdict plugin did not start (exit {out.exit_code}): {out.output_tail[-800:]}"
        )
    out.cases = cases
    values = list(cases.values())
    out.passed, out.failed = values.count("passed"), values.count("failed")
    out.errors, out.skipped = values.count("error"), values.count("skipped")
    out.total = max(task.num_tests or 0, len(values), len(set(collected)))
    if out.tampered:
        logger.warning("tests reward: run scored 0, tampering found: %s", "; ".join(out.tampered)[:500])
        out.passed = 0
    return out


@takes_context
async def tests_reward(ctx: PluginContext, sample: Sample) -> float:
    """Reward from the task's hidden tests (see the module docstring); details in ``metadata["reward_tests"]``.

    :return: the pass fraction (``--reward-tests-mode fraction``) or 1.0/0.0 (``all``).
    :raises vime_core.data.workspace_task.TaskError: the row has no hidden tests or is malformed.
    :raises RewardInfraError: the test run could not be set up (the sample is excluded, not scored 0).
    :raises vime_core.sandbox.SandboxError: the sandbox failed (likewise).
    """
    task = WorkspaceTask.from_metadata(sample.metadata, need_tests=True)
    result = AgentResult.from_metadata(sample.metadata)
    files, ignored = result_files(task, result, task.tests)
    opts = ctx.plugin(RewardTestsFlags)
    timeout_s = float(task.timeout_s or opts.reward_tests_timeout)
    outcome = await run_tests(ctx, task, files, timeout_s=timeout_s, python=opts.reward_tests_python)
    outcome.ignored = ignored
    sample.metadata["reward_tests"] = asdict(outcome)
    return score(outcome, opts.reward_tests_mode)
