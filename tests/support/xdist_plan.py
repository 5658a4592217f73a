"""How the suite is split over pytest-xdist workers (``-n 2 --dist loadgroup``, the README's test command).

Each test file is one unit of work, so its module-scoped fixtures (a `vime run` several tests read) run once.
Files are put together in one unit where running them side by side would cost more than it saves:

- ``session-engine``: every file with a test that uses the session's vLLM server or router (``vllm_server``,
  ``router``): one worker starts that server, not both.
- ``memory-heavy``: the files that boot VMs or several engines at once (localvm, the coding-agent runs, the two-node
  cluster): never two of them at the same time on the 24 GiB machine. (test_vime_run_sandbox.py, whose runs boot
  VMs too, is ``exclusive``: it runs alone, and it uses the session engine.)

Units start longest first (``tests/file_seconds.json``: seconds per file from an earlier session, and
``tests/file_seconds_extended.json``: the share of the file's ``extended`` tests, so a run of one tier counts that
tier's share; a file not listed counts 0), so the two workers finish close together.
``VIME_TEST_FILE_SECONDS_OUT=PATH`` writes both tables again (:func:`write_seconds`).

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
#: the seconds of each file's tests marked ``extended`` (the rest of the file's seconds are the gate's)
EXTENDED_SECONDS_FILE = SECONDS_FILE.with_name("file_seconds_extended.json")
#: the tiers of docs/testing.md: a test marked ``extended`` is in the extended tier, every other in the gate
TIERS = ("gate", "extended")
#: the ``user_properties`` key of a test report naming the test's tier (set by tests/conftest.py on the worker)
TIER_PROPERTY = "vime_tier"

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
        "tests/integration/test_vime_run_sandbox.py",
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
)


def file_of(nodeid: str) -> str:
    """The test file of a node id (the part before the first ``::``)."""
    return nodeid.split("::", 1)[0]


def group_of(path: str) -> str:
    """The unit of work of a test file: ``memory-heavy``, ``session-engine`` or the file's own path."""
    if any(path == p or (p.endswith("/") and path.startswith(p)) for p in MEMORY_HEAVY):
        return "memory-heavy"
    return "session-engine" if path in SESSION_ENGINE_FILES else path


def read_seconds(path: Path) -> dict[str, float]:
    """A ``{file: seconds}`` table (empty when ``path`` is missing)."""
    if not path.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}


def extended_table(path: Path) -> Path:
    """The table of the ``extended`` shares beside the seconds table ``path`` (``X.json`` → ``X_extended.json``)."""
    return path.with_name(f"{path.stem}_extended{path.suffix}")


def expected_seconds() -> dict[str, float]:
    """Seconds per test file from :data:`SECONDS_FILE` (empty when the file is missing)."""
    return read_seconds(SECONDS_FILE)


def expected_extended_seconds() -> dict[str, float]:
    """Seconds of each file's ``extended`` tests from :data:`EXTENDED_SECONDS_FILE`."""
    return read_seconds(EXTENDED_SECONDS_FILE)


def tier_of(item) -> str:
    """``extended`` for a test marked so (on itself, its class, its module or its parameter), else ``gate``."""
    return "extended" if item.get_closest_marker("extended") is not None else "gate"


def tier_share(total: float, extended: float | None, tiers: set[str]) -> float:
    """The seconds of a file's tests of ``tiers``: ``extended`` of ``total`` is the extended tests' share, the rest
    the gate's; a file whose share is not recorded (``extended`` None) counts ``total``."""
    if extended is None or tiers >= set(TIERS):
        return total
    return extended if "extended" in tiers else max(total - extended, 0.0)


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
    seconds, extended = expected_seconds(), expected_extended_seconds()
    tiers: dict[str, set[str]] = defaultdict(set)
    for item in items:
        tiers[file_of(item.nodeid)].add(tier_of(item))
    total: dict[str, float] = defaultdict(float)
    for path, present in tiers.items():
        total[group_of(path)] += tier_share(seconds.get(path, 0.0), extended.get(path), present)
    return sorted(items, key=lambda item: -total[group_of(file_of(item.nodeid))])


def loadgroup_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker of ``--dist loadgroup``."""
    return hasattr(config, "workerinput") and bool(config.getvalue("loadgroup"))


class LongestFirst:
    """Registered by tests/conftest.py: on a ``--dist loadgroup`` worker, the tests that run (after ``-m`` deselected
    the others) in :func:`order`."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        if loadgroup_worker(config):
            items[:] = order(items)


class GroupScheduling(LoadScopeScheduling):
    """xdist's load-scope scheduling with :func:`group_of` as the scope: a unit of work goes to one worker whole,
    units in collection order (:func:`order` on the workers)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        config.option.loadscopereorder = False  # xdist would order the units by test count, not by :func:`order`
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return group_of(file_of(nodeid))


def merged_seconds(
    old_total: dict[str, float], old_extended: dict[str, float], session: dict[str, dict[str, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    """The seconds tables after a session: each tier of a file that ran in the session takes the session's seconds,
    a tier that did not run keeps the old share (so a gate run and an extended run together give the whole table).

    :param old_total: ``{file: seconds}`` of all its tests (:data:`SECONDS_FILE`).
    :param old_extended: ``{file: seconds}`` of its ``extended`` tests (:data:`EXTENDED_SECONDS_FILE`).
    :param session: ``{file: {tier: seconds}}`` of the tiers that ran.
    :return: the new ``(total, extended)`` tables, for every file of either.
    """
    total, extended = dict(old_total), dict(old_extended)
    for path, tiers in session.items():
        old_ext = old_extended.get(path, 0.0)
        gate = tiers.get("gate", max(old_total.get(path, 0.0) - old_ext, 0.0))
        ext = tiers.get("extended", old_ext)
        total[path], extended[path] = gate + ext, ext
    return total, extended


def write_seconds(path: str, session: dict[str, dict[str, float]], root: Path) -> None:
    """Merge the session's ``{file: {tier: seconds}}`` into the table at ``path`` and its :func:`extended_table`
    (:func:`merged_seconds`), and write both as JSON: rounded, longest first, files under 1 s and files that no
    longer exist under ``root`` left out."""
    table = Path(path)
    ext_table = extended_table(table)
    total, extended = merged_seconds(read_seconds(table), read_seconds(ext_table), session)
    for out, rows in ((table, total), (ext_table, extended)):
        kept = [(f, round(s)) for f, s in rows.items() if s >= 1.0 and (root / f).is_file()]
        kept.sort(key=lambda r: -r[1])
        out.write_text(json.dumps(dict(kept), indent=1) + "\n")


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
