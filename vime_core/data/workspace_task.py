"""Workspace tasks: the prompt-data row format of coding-agent RL (``--generate coding_agent``, ``--reward tests``).

:class:`WorkspaceTask` reads a row's metadata (the workspace the agent starts from, the hidden tests),
:class:`AgentResult` is what ``coding_agent`` writes back after the episode, :func:`result_files` builds the
workspace as the agent left it and :func:`is_guarded` says which of the agent's files a test run must ignore. The
row format: docs/agents.md, "Workspace tasks".
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

WORKSPACE_KEY = "workspace"
TESTS_KEY = "tests"
RESULT_KEY = "agent_result"

#: File names an agent may not contribute to a test run (anywhere in the tree): they would change what pytest
#: collects, how it is configured, or what Python imports before the tests run.
GUARDED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pytest.py",
        "py.py",
        "sitecustomize.py",
        "usercustomize.py",
    }
)
#: Top-level directories an agent may not contribute (shadowing the test runner).
GUARDED_DIRS = frozenset({"_pytest", "pytest", "pluggy", ".vime-tests", ".vime-results", ".vime-pytest"})


class TaskError(ValueError):
    """A workspace-task row is malformed; the message names the metadata key."""


def check_relpath(path: str, where: str = "path") -> str:
    """``path`` normalised (POSIX), checked to stay inside its root.

    :raises TaskError: absolute, empty, or escaping with ``..``.
    """
    if not isinstance(path, str) or not path:
        raise TaskError(f"{where}: file paths must be non-empty strings, got {path!r}")
    norm = posixpath.normpath(path)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise TaskError(f"{where}: {path!r} must be a relative path inside the workspace")
    return norm


def _files(obj: Any, where: str) -> dict[str, str]:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise TaskError(f"{where} must be an object mapping relative paths to file contents")
    out: dict[str, str] = {}
    for k, v in obj.items():
        if not isinstance(v, str):
            raise TaskError(f"{where}[{k!r}] must be a string (UTF-8 text), got {type(v).__name__}")
        out[check_relpath(k, where)] = v
    return out


@dataclass
class WorkspaceTask:
    """The task part of a row's metadata.

    :ivar files: starting workspace, path → text.
    :ivar tests: hidden test files, path → text.
    :ivar num_tests: expected number of tests (``None``: as many as the run reports).
    :ivar timeout_s: seconds for the whole test run (``None``: the reward's ``--reward-tests-timeout``).
    """

    files: dict[str, str] = field(default_factory=dict)
    tests: dict[str, str] = field(default_factory=dict)
    num_tests: int | None = None
    timeout_s: float | None = None

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], *, need_tests: bool = False) -> WorkspaceTask:
        """Parse ``metadata["workspace"]`` and ``metadata["tests"]``.

        :param need_tests: raise if there are no hidden tests.
        :raises TaskError: a malformed entry (naming it), or no tests when ``need_tests``.
        """
        ws = metadata.get(WORKSPACE_KEY) or {}
        tests = metadata.get(TESTS_KEY) or {}
        if not isinstance(ws, dict) or not isinstance(tests, dict):
            raise TaskError(f"metadata[{WORKSPACE_KEY!r}] and metadata[{TESTS_KEY!r}] must be objects")
        task = cls(
            files=_files(ws.get("files"), f"metadata.{WORKSPACE_KEY}.files"),
            tests=_files(tests.get("files"), f"metadata.{TESTS_KEY}.files"),
            num_tests=int(tests["num_tests"]) if tests.get("num_tests") is not None else None,
            timeout_s=float(tests["timeout_s"]) if tests.get("timeout_s") is not None else None,
        )
        if need_tests and not task.tests:
            raise TaskError(
                f"metadata.{TESTS_KEY}.files is missing or empty: the tests reward needs the task's hidden tests "
                "(see vime_core.data.workspace_task; --metadata-key must name the row's metadata object)"
            )
        return task


@dataclass
class AgentResult:
    """What an episode left in the workspace (``metadata["agent_result"]``).

    :ivar changed: path → new text, or ``None`` for a deleted file (relative to the workspace).
    :ivar diff: ``git diff`` of the workspace against the task's files (text; binary files as git shows them).
    :ivar skipped: paths the collector did not record (binary, or over the size limit), with the reason.
    :ivar agent_status: how the agent ended (:class:`vime_core.agent.harness.AgentRunResult` ``status``).
    :ivar exit_code: the agent CLI's exit code.
    :ivar duration_s: the agent's wall time, seconds.
    """

    changed: dict[str, str | None] = field(default_factory=dict)
    diff: str = ""
    skipped: dict[str, str] = field(default_factory=dict)
    agent_status: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "changed": dict(self.changed),
            "diff": self.diff,
            "skipped": dict(self.skipped),
            "agent_status": self.agent_status,
            "exit_code": self.exit_code,
            "duration_s": self.duration_s,
        }

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> AgentResult | None:
        """``metadata["agent_result"]`` parsed, or ``None`` if absent.

        :raises TaskError: malformed.
        """
        d = metadata.get(RESULT_KEY)
        if d is None:
            return None
        if not isinstance(d, dict):
            raise TaskError(f"metadata[{RESULT_KEY!r}] must be an object")
        changed: dict[str, str | None] = {}
        for k, v in (d.get("changed") or {}).items():
            if v is not None and not isinstance(v, str):
                raise TaskError(f"metadata.{RESULT_KEY}.changed[{k!r}] must be text or null")
            changed[check_relpath(k, f"metadata.{RESULT_KEY}.changed")] = v
        return cls(
            changed=changed,
            diff=str(d.get("diff") or ""),
            skipped=dict(d.get("skipped") or {}),
            agent_status=str(d.get("agent_status") or ""),
            exit_code=d.get("exit_code"),
            duration_s=float(d.get("duration_s") or 0.0),
        )


def is_guarded(path: str) -> bool:
    """True if an agent-written file at ``path`` must be ignored by a test run: test modules (``test_*.py``,
    ``*_test.py``), ``conftest.py``, pytest/tox/setup.cfg configuration, import hooks (``sitecustomize.py``,
    ``*.pth``), modules shadowing the test runner, and anything under vime's own test directories."""
    parts = check_relpath(path).split("/")
    name = parts[-1]
    if name in GUARDED_NAMES or name.endswith(".pth"):
        return True
    if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
        return True
    return parts[0] in GUARDED_DIRS


def result_files(task: WorkspaceTask, result: AgentResult | None, hidden_tests: dict[str, str] | None = None):
    """The workspace as the agent left it, minus what a test run must ignore.

    :param hidden_tests: the task's tests; an agent file at one of their paths (or in one of their top-level
        directories) is ignored too.
    :return: ``(files, ignored)``: path → text, and the sorted agent paths that were dropped.
    """
    files = dict(task.files)
    ignored: list[str] = []
    test_dirs = {p.split("/")[0] for p in (hidden_tests or {}) if "/" in p}
    for path, text in (result.changed if result else {}).items():
        if is_guarded(path) or path in (hidden_tests or {}) or path.split("/")[0] in test_dirs:
            ignored.append(path)
            continue
        if text is None:
            files.pop(path, None)
        else:
            files[path] = text
    # task files that look like tests (never the agent's doing) are kept: only agent changes are filtered
    return files, sorted(ignored)
