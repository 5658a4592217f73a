"""How the suite is split over pytest-xdist workers (``-n 2 --dist loadgroup``, the README's test command).

Each test file is one unit of work, so its module-scoped fixtures (a `vime run` several tests read) run once.
Files are put together in one unit where running them side by side would cost more than it saves:

- ``session-engine``: every file with a test that uses the session's vLLM server or router (``vllm_server``,
  ``router``): one worker starts that server, not both.
- ``memory-heavy``: the files that boot VMs or several engines at once (localvm, the coding-agent runs, the two-node
  cluster): never two of them at the same time on the 24 GiB machine.

Units start longest first (``tests/file_seconds.json``: seconds per file from an earlier session; a file not
listed counts 0), so the two workers finish close together. Write a new table with
``VIME_TEST_FILE_SECONDS_OUT=PATH``.

xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming node ids, which pytest 9 no longer allows, so
:class:`GroupScheduling` (installed by tests/conftest.py) groups by file path instead, and each worker checks that
:data:`SESSION_ENGINE_FILES` names exactly the files whose tests use the session engine (:func:`check_groups`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

SECONDS_FILE = Path(__file__).resolve().parents[1] / "file_seconds.json"

#: fixtures of tests/conftest.py that start the session's one vLLM server
SESSION_ENGINE_FIXTURES = ("vllm_server", "router")

#: the files with a test that uses one of :data:`SESSION_ENGINE_FIXTURES` (checked on every xdist run)
SESSION_ENGINE_FILES = frozenset(
    {
        "tests/integration/test_agent_gateway_vllm.py",
        "tests/integration/test_examples_runs.py",
        "tests/integration/test_examples_vllm.py",
        "tests/integration/test_external_engines.py",
        "tests/integration/test_loop_modes.py",
        "tests/integration/test_multi_turn_vllm.py",
        "tests/integration/test_overlong_vllm.py",
        "tests/integration/test_partial_rollout_vllm.py",
        "tests/integration/test_rollout_engine.py",
        "tests/integration/test_rollout_seed_vllm.py",
        "tests/integration/test_sampling_params_vllm.py",
        "tests/integration/test_vime_eval.py",
        "tests/integration/test_vime_run.py",
        "tests/integration/test_vime_run_math.py",
        "tests/integration/test_vime_run_ppo_distill.py",
        "tests/integration/test_weight_sync_delta.py",
        "tests/integration/test_weight_sync_nccl.py",
    }
)

#: files (or folders, ending in "/") that must not run beside each other
MEMORY_HEAVY = (
    "plugins/vime-sandbox-localvm/tests/",
    "tests/integration/test_coding_agent_localvm.py",
    "tests/integration/test_coding_agent_run.py",
    "tests/integration/test_cluster_two_node.py",
    "tests/integration/test_vime_run_sandbox.py",
)


def file_of(nodeid: str) -> str:
    """The test file of a node id (the part before the first ``::``)."""
    return nodeid.split("::", 1)[0]


def group_of(path: str) -> str:
    """The unit of work of a test file: ``memory-heavy``, ``session-engine`` or the file's own path."""
    if any(path == p or (p.endswith("/") and path.startswith(p)) for p in MEMORY_HEAVY):
        return "memory-heavy"
    return "session-engine" if path in SESSION_ENGINE_FILES else path


def expected_seconds() -> dict[str, float]:
    """Seconds per test file from :data:`SECONDS_FILE` (empty when the file is missing)."""
    if not SECONDS_FILE.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(SECONDS_FILE.read_text()).items()}


def check_groups(items: list) -> None:
    """Refuse a run where :data:`SESSION_ENGINE_FILES` is out of date.

    :raises pytest.UsageError: naming the files to add to or drop from it.
    """
    using = {
        file_of(item.nodeid)
        for item in items
        if any(f in getattr(item, "fixturenames", ()) for f in SESSION_ENGINE_FIXTURES)
    }
    collected = {file_of(item.nodeid) for item in items}
    missing, stale = sorted(using - SESSION_ENGINE_FILES), sorted((SESSION_ENGINE_FILES & collected) - using)
    if missing or stale:
        raise pytest.UsageError(
            f"tests/support/xdist_plan.py: SESSION_ENGINE_FILES is out of date: add {missing}, drop {stale}"
        )


def order(items: list) -> list:
    """The items with the longest units first (a stable sort: within a unit, collection order).

    :param items: the collected pytest items.
    :return: the same items, reordered.
    """
    seconds = expected_seconds()
    total: dict[str, float] = defaultdict(float)
    for path in {file_of(item.nodeid) for item in items}:
        total[group_of(path)] += seconds.get(path, 0.0)
    return sorted(items, key=lambda item: -total[group_of(file_of(item.nodeid))])


class GroupScheduling(LoadScopeScheduling):
    """xdist's load-scope scheduling with :func:`group_of` as the scope: a unit of work goes to one worker whole,
    units in collection order (:func:`order` on the workers)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        config.option.loadscopereorder = False  # xdist would order the units by test count, not by :func:`order`
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return group_of(file_of(nodeid))


def write_seconds(path: str, file_seconds: dict[str, float]) -> None:
    """Write ``{file: seconds}`` (rounded, longest first, files under 1 s left out) as JSON to ``path``."""
    rows = sorted(((f, round(s)) for f, s in file_seconds.items() if s >= 1.0), key=lambda r: -r[1])
    Path(path).write_text(json.dumps(dict(rows), indent=1) + "\n")


class ExclusiveLock:
    """Under pytest-xdist, a test marked ``exclusive`` runs while no other test runs: it counts or reaps what every
    process on the machine left (sandbox leak tests), which another worker's sandboxes would change. The other tests
    share the lock. A writer-preferring read-write lock over two ``flock`` files in the system temp directory (one
    pair per checkout): an exclusive test first takes the turnstile, so the other worker's next test waits for it.

    Registered as a plugin by tests/conftest.py so that it also wraps the tests under plugins/.
    """

    def __init__(self, root: Path) -> None:
        import hashlib
        import tempfile

        key = hashlib.sha1(str(root).encode()).hexdigest()[:12]
        self.main = Path(tempfile.gettempdir()) / f"vime-tests-{key}.lock"
        self.turnstile = Path(tempfile.gettempdir()) / f"vime-tests-{key}.turnstile"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):  # noqa: ARG002 - pytest's hook signature
        """Hold the shared lock around one test's setup, call and teardown (the exclusive one if it is marked)."""
        import fcntl

        exclusive = item.get_closest_marker("exclusive") is not None
        with self.main.open("a") as main, self.turnstile.open("a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            if exclusive:
                fcntl.flock(main, fcntl.LOCK_EX)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            else:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                fcntl.flock(main, fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(main, fcntl.LOCK_UN)
