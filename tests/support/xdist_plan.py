"""How the suite is split over pytest-xdist workers (``-n 2 --dist loadgroup``, the README's test command).

Each test file is one unit of work, so its module-scoped fixtures (a `vime run` several tests read) run once.
Files are put together in one unit where running them side by side would cost more than it saves:

- ``session-engine``: every file with a test that uses the session's vLLM server or router (``vllm_server``,
  ``router``): one worker starts that server, not both.
- ``memory-heavy``: the files that boot VMs or several engines at once (localvm, the coding-agent runs, the two-node
  cluster): never two of them at the same time on the 24 GiB machine.

Units start longest first (``tests/file_seconds.json``: seconds per file from an earlier serial session; a file not
listed counts 0), so the two workers finish close together. Write a new table with
``VIME_TEST_FILE_SECONDS_OUT=PATH``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).resolve().parents[1] / "file_seconds.json"

#: fixtures of tests/conftest.py that start the session's one vLLM server
SESSION_ENGINE_FIXTURES = ("vllm_server", "router")

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


def expected_seconds() -> dict[str, float]:
    """Seconds per test file from :data:`SECONDS_FILE` (empty when the file is missing)."""
    if not SECONDS_FILE.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(SECONDS_FILE.read_text()).items()}


def groups(items: list) -> dict[str, str]:
    """The xdist group of each test file among ``items`` (pytest items): ``session-engine``, ``memory-heavy`` or the
    file's own path."""
    files: dict[str, str] = {}
    for item in items:
        path = file_of(item.nodeid)
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in MEMORY_HEAVY):
            files[path] = "memory-heavy"
        elif any(f in getattr(item, "fixturenames", ()) for f in SESSION_ENGINE_FIXTURES):
            files[path] = "session-engine"
        else:
            files.setdefault(path, path)
    return files


def plan(items: list) -> list:
    """Mark each item with its ``xdist_group`` and return the items with the longest groups first (a stable sort:
    within a group, collection order).

    :param items: the collected pytest items (marked in place).
    :return: the same items, reordered.
    """
    group_of = groups(items)
    seconds = expected_seconds()
    total: dict[str, float] = defaultdict(float)
    for path, group in group_of.items():
        total[group] += seconds.get(path, 0.0)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of[file_of(item.nodeid)]))
    return sorted(items, key=lambda item: -total[group_of[file_of(item.nodeid)]])


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
