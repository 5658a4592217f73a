"""vime's verdict plugin: shipped into the test sandbox as ``.vime-pytest/vime_verdict.py`` and loaded with
``-p vime_verdict`` before any test module (and so any of the agent's code) is imported. Standard library and pytest
only.

It is the only results channel of the tests reward; nothing is read from a file the code under test could write:

* **Key**: one line on the process's standard input, sent by the harness with the command and read here at load
  time, before any agent code runs; stdin is then closed. It lives only in this module's closures.
* **Verdicts**: outermost (``tryfirst``) hook wrappers around the setup, call and teardown of each test see the
  exceptions those phases raise; a test passed iff none raised. pytest's reports are not consulted, so patching
  them (``TestReport``, ``pytest_runtest_makereport``, the terminal or JUnit reporters) changes nothing.
* **Integrity**: before the first test module is imported, the functions the verdict depends on (pytest's runner
  and call path, pluggy's hook calling) and the registered plugins and hook implementations are recorded; after
  every test they are compared (identity and code object), and a trace or profile function must not be set. Any
  change marks the run ``tampered`` (the harness then scores it 0).
* **Channel**: one line per test, ``VIME-R <hmac-sha256 hex> <json>``, written to file descriptor 3 (the harness's
  pipe, not a file), and a final ``{"end": true, "tampered": ..., "n": ...}`` record. The harness drops the run as
  tampered if a line does not authenticate, and counts a test without a record as failed (a process that exits
  early reports only the tests that really finished).

Not prevented: code that targets this module itself (reads the key out of a closure, rewrites these functions'
code objects, or writes process memory through ``ctypes``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
import threading

import pluggy
import pytest
from _pytest import python as _py
from _pytest import reports as _reports
from _pytest import runner as _runner

RESULTS_FD = 3
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def _watched() -> dict[str, object]:
    """The callables a test's verdict depends on, by name (their identity and code objects are compared)."""
    return {
        "runner.runtestprotocol": _runner.runtestprotocol,
        "runner.call_and_report": _runner.call_and_report,
        "runner.CallInfo.from_call": _runner.CallInfo.__dict__["from_call"].__func__,
        "runner.pytest_runtest_call": _runner.pytest_runtest_call,
        "python.Function.runtest": _py.Function.runtest,
        "python.pytest_pyfunc_call": _py.pytest_pyfunc_call,
        "reports.TestReport.from_item_and_call": _reports.TestReport.__dict__["from_item_and_call"].__func__,
        "pluggy.HookCaller.__call__": pluggy.HookCaller.__call__,
        "pluggy._multicall": pluggy._callers._multicall,
        "pluggy.PluginManager._hookexec": pluggy.PluginManager._hookexec,
    }


def _make() -> dict[str, object]:
    """Build the hook implementations around private state (key, results fd, snapshots)."""
    key = sys.stdin.buffer.readline().strip()
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    except OSError:
        pass
    write, new_mac, dumps, sha256 = os.write, hmac.new, json.dumps, hashlib.sha256
    gettrace, getprofile = sys.gettrace, sys.getprofile
    threading_gettrace = getattr(threading, "gettrace", lambda: None)
    threading_getprofile = getattr(threading, "getprofile", lambda: None)
    watched = _watched()
    codes = {name: getattr(f, "__code__", None) for name, f in watched.items()}
    state: dict[str, object] = {"n": 0, "tampered": [], "phases": {}, "plugins": None, "impls": None, "pm": None}
    state["root"] = None

    def emit(record: dict[str, object]) -> None:
        body = dumps(record, sort_keys=True)
        mac = new_mac(key, body.encode(), sha256).hexdigest()
        try:
            write(RESULTS_FD, f"VIME-R {mac} {body}\n".encode())
        except OSError:
            pass
        state["n"] = int(state["n"]) + 1  # type: ignore[call-overload]

    def hook_impls(pm: object) -> list[tuple[str, tuple[object, ...]]]:
        out = []
        for name in ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call",
                     "pytest_runtest_teardown", "pytest_pyfunc_call"):  # fmt: skip
            caller = getattr(pm.hook, name)  # type: ignore[attr-defined]
            out.append((name, tuple(i.function for i in caller.get_hookimpls())))
        return out

    def check() -> list[str]:
        problems = []
        now = _watched()
        for name, f in watched.items():
            if now[name] is not f or getattr(now[name], "__code__", None) is not codes[name]:
                problems.append(f"{name} was replaced")
        for name, f in (("sys.settrace", gettrace()), ("sys.setprofile", getprofile())):
            if f is not None:
                problems.append(f"{name} is set")
        if threading_gettrace() is not None or threading_getprofile() is not None:
            problems.append("threading.settrace/setprofile is set")
        pm = state["pm"]
        if pm is not None and state["plugins"] is not None:
            for plugin in pm.get_plugins():  # type: ignore[attr-defined]
                if id(plugin) in state["plugins"]:  # type: ignore[operator]
                    continue
                file = str(getattr(plugin, "__file__", ""))
                if not (getattr(plugin, "__name__", "").endswith("conftest") and file.startswith(str(state["root"]))):
                    problems.append(f"a pytest plugin was registered: {plugin!r}")
            if state["impls"] is not None and hook_impls(pm) != state["impls"]:
                problems.append("the runtest hook implementations changed")
        return problems

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(session: pytest.Session) -> None:
        pm = session.config.pluginmanager
        state["pm"] = pm
        state["root"] = session.config.rootpath  # the hidden tests' directory (--rootdir): its conftests may load
        state["plugins"] = {id(p) for p in pm.get_plugins()}

    def pytest_collectreport(report: pytest.CollectReport) -> None:
        if report.failed:
            emit({"id": report.nodeid or "<collection>", "outcome": "error"})

    def pytest_collection_finish(session: pytest.Session) -> None:
        state["impls"] = hook_impls(session.config.pluginmanager)
        emit({"collected": [item.nodeid for item in session.items]})

    def phase(name: str):
        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def wrapper(item: pytest.Item):
            outcome = yield
            exc = outcome.exception
            verdict = "passed"
            if exc is not None:
                if isinstance(exc, pytest.skip.Exception):
                    verdict = "skipped"
                else:
                    verdict = "failed" if name == "call" else "error"
            state["phases"].setdefault(item.nodeid, {})[name] = verdict  # type: ignore[union-attr]

        wrapper.__name__ = f"pytest_runtest_{name}"
        return wrapper

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: object):
        state["phases"][item.nodeid] = {}  # type: ignore[index]
        yield
        phases = state["phases"].pop(item.nodeid, {})  # type: ignore[union-attr]
        if "call" not in phases and all(v == "passed" for v in phases.values()):
            phases["call"] = "error"  # the test never ran
        verdict = max(phases.values(), key=RANK.__getitem__) if phases else "error"
        problems = check()
        if problems:
            state["tampered"] = list(state["tampered"]) + [f"{item.nodeid}: {p}" for p in problems]  # type: ignore[call-overload]
        emit({"id": item.nodeid, "outcome": verdict})

    emit({"ready": True})  # before any agent code: its absence means the plugin itself could not start

    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        problems = check()
        tampered = list(state["tampered"]) + problems  # type: ignore[call-overload]
        emit({"end": True, "tampered": tampered, "n": state["n"]})

    return {
        "pytest_sessionstart": pytest_sessionstart,
        "pytest_collectreport": pytest_collectreport,
        "pytest_collection_finish": pytest_collection_finish,
        "pytest_runtest_setup": phase("setup"),
        "pytest_runtest_call": phase("call"),
        "pytest_runtest_teardown": phase("teardown"),
        "pytest_runtest_protocol": pytest_runtest_protocol,
        "pytest_sessionfinish": pytest_sessionfinish,
    }


if __name__ == "vime_verdict":  # only as the sandbox's plugin (importing it elsewhere must not read stdin)
    globals().update(_make())
