"""No server child outlives the process that started it (:mod:`vime_core.engines.process_guard`).

The server here is a real process tree shaped like vLLM's: an "API server" that starts an "engine core" child which
ignores SIGTERM. It is started through :meth:`ManagedServer.start` (the code path of every engine and the router)
by a driver process that the test then kills with SIGKILL — the sequence that left VLLM::EngineCore orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    import httpx
    from vime_core.engines.process import ManagedServer

    CORE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    API = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r]); time.sleep(600)" % CORE
    )

    class Tree(ManagedServer):
        def __init__(self, log):
            self.url, self.log_path, self.proc, self._log_file = "http://127.0.0.1:1", Path(log), None, None
            self._http = httpx.Client()

        def command(self):
            return [sys.executable, "-c", API]

    server = Tree(sys.argv[1])
    mode = sys.argv[2]
    if mode == "thread":  # started from a thread that then exits (a Ray actor's thread pool may do that)
        t = threading.Thread(target=server.start)
        t.start()
        t.join()
    else:
        server.start()
    print(server.proc.pid, flush=True)
    if mode == "stop":
        time.sleep(1.0)
        server.stop(grace_s=2.0)
        print("stopped", flush=True)
    time.sleep(600)
    """
)


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of group ``pgid``."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [
        int(pid) for pid, stat in (line.split()[:2] for line in out.splitlines() if line.strip()) if stat[0] != "Z"
    ]


def _start_driver(tmp_path, mode: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "server.log"), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pgid = int(driver.stdout.readline())
        deadline = time.monotonic() + 20
        while not any("\x00import signal" in _cmdline(pid) for pid in _group(pgid)):  # the "engine core" runs
            assert time.monotonic() < deadline, f"the tree did not start: {_group(pgid)}"
            time.sleep(0.1)
    except BaseException:
        driver.kill()
        driver.wait()
        raise
    return driver, pgid


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(pgid: int, within_s: float) -> float:
    t0 = time.monotonic()
    while _group(pgid):
        if time.monotonic() - t0 > within_s:
            left = _group(pgid)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes {left} of the server's group outlived the driver by {within_s} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def test_sigkill_of_the_starter_leaves_no_process_of_the_server_group(tmp_path):
    driver, pgid = _start_driver(tmp_path, "plain")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # the guard notices within 0.5 s, SIGTERMs the group, SIGKILLs the SIGTERM-ignoring core after 5 s
    assert _wait_gone(pgid, within_s=10.0) < 10.0


def test_a_server_started_from_a_thread_that_exits_keeps_running(tmp_path):
    driver, pgid = _start_driver(tmp_path, "thread")
    try:
        before = _group(pgid)
        time.sleep(1.5)  # the parent-death signal of the exited thread has fired by now
        assert _group(pgid) == before and len(before) >= 2  # (guard,) API server, engine core
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    _wait_gone(pgid, within_s=10.0)


def test_a_deliberate_stop_takes_the_whole_group(tmp_path):
    driver, pgid = _start_driver(tmp_path, "stop")
    try:
        assert driver.stdout.readline().strip() == "stopped"
        assert _group(pgid) == []  # stop() returned: the core that ignores SIGTERM is gone too
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()


def test_sigkill_of_the_process_the_starter_holds_leaves_nothing(tmp_path):
    """Ray SIGKILLs the direct children of a worker that exits: the guard itself dies, its watcher stops the group."""
    driver, pgid = _start_driver(tmp_path, "plain")
    try:
        os.kill(pgid, signal.SIGKILL)  # the starter's child (`server.proc`): the guard, or on main the API server
        assert _wait_gone(pgid, within_s=10.0) < 10.0
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


REAPED_DRIVER = textwrap.dedent(
    """
    import subprocess, sys, time
    from vime_core.engines.process import start_run_reaper
    start_run_reaper(grace_s=1.0)
    # like Ray's agents after a killed driver: a process of its own session that ignores SIGTERM and outlives it
    core = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", core], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _kill_driver_then_wait_for_its_child(source: str, seen_s: float, within_s: float, check=None) -> None:
    """Run the driver ``source`` (it prints its child's pid), SIGKILL it after ``seen_s`` seconds and require the
    child to be gone within ``within_s`` seconds; ``check(child)`` runs first."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    driver = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True, env=env)
    child = int(driver.stdout.readline())
    try:
        if check is not None:
            check(child)
        time.sleep(seen_s)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        t0 = time.monotonic()
        while _alive(child):
            assert time.monotonic() - t0 < within_s, "the driver's child outlived it"
            time.sleep(0.1)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_run_reaper_kills_what_carries_the_runs_marker_after_the_driver_is_killed():
    _kill_driver_then_wait_for_its_child(REAPED_DRIVER, seen_s=1.0, within_s=5.0)


UNMARKED_DRIVER = REAPED_DRIVER.replace(
    'child = subprocess.Popen([sys.executable, "-c", core], start_new_session=True)',
    'child = subprocess.Popen([sys.executable, "-c", core], start_new_session=True, env={})',
)


def test_the_run_reaper_kills_the_drivers_descendants_whose_environment_lost_the_marker():
    """Ray's agents overwrite their environment with their process title (``ray::DashboardAgent``: an empty
    ``/proc/<pid>/environ``) and were left with parent 1 after SIGINT + SIGKILL of the driver right after setup: the
    reaper also kills what it saw below the driver (here a child started with an empty environment)."""
    assert "env={}" in UNMARKED_DRIVER

    def environment_lacks_the_marker(child: int) -> None:
        with open(f"/proc/{child}/environ", "rb") as f:
            assert b"VIME_RUN_ID" not in f.read()

    # 3 s: the reaper (scanning every 0.5 s once its interpreter is up, which a loaded CI machine may take a second
    # or more to do) has seen the child below the driver
    _kill_driver_then_wait_for_its_child(UNMARKED_DRIVER, seen_s=3.0, within_s=6.0, check=environment_lacks_the_marker)


def test_the_guard_pins_the_server_to_the_cores_it_is_given():
    """``VIME_CPU_AFFINITY=0`` (:data:`vime_core.engines.process_guard.CPU_AFFINITY_ENV`): the server and the threads
    and processes it starts run on core 0 only; without it they keep every core of the starter."""
    from vime_core.engines.process import guarded

    probe = [sys.executable, "-c", "import os, threading; t = threading.Thread(target=lambda: print(sorted("
             "os.sched_getaffinity(0)))); t.start(); t.join()"]  # fmt: skip
    pinned = subprocess.run(guarded(probe, 1.0), env={**os.environ, "VIME_CPU_AFFINITY": "0"}, capture_output=True,
                            text=True, timeout=60, start_new_session=True)  # the guard leads its group  # fmt: skip
    assert pinned.stdout.strip() == "[0]", pinned
    free = subprocess.run(guarded(probe, 1.0), env={k: v for k, v in os.environ.items() if k != "VIME_CPU_AFFINITY"},
                          capture_output=True, text=True, timeout=60, start_new_session=True)  # fmt: skip
    assert free.stdout.strip() == str(sorted(os.sched_getaffinity(0))), free


SIGINT_DRIVER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from vime_core.cli import commands as cli
    from vime_core.engines.process import start_run_reaper

    def fake_run(argv):
        start_run_reaper(grace_s=30.0)  # far longer than the test waits: only the driver's "reap now" can end it
        # a process of the run that ignores SIGTERM and outlives the driver's own cleanup
        core = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", core], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(1.0)  # the reaper notes the driver's descendants every 0.5 s
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(600)

    cli.COMMANDS["fake"] = fake_run
    code = cli.main(["fake"])
    print("exit", code, flush=True)
    """
)


def test_the_sigint_line_says_every_process_is_gone_only_once_the_reaper_has_finished():
    """The driver's line comes after its run reaper, told to reap at once, killed the run's leftover process and
    exited: when the line is printed nothing of the run is left (it was printed 6 s before the reaper's end)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    driver = subprocess.Popen([sys.executable, "-c", SIGINT_DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)  # fmt: skip
    child = int(driver.stdout.readline())
    try:
        out, err = driver.communicate(timeout=60)
        assert err.strip().splitlines()[-1] == "vime fake: stopped by SIGINT; every process it started is gone"
        assert not _alive(child)  # already when the driver exited, not 30 s later
        assert out.strip() == "exit 130"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


GUARD = os.path.join(ROOT, "vime_core", "engines", "process_guard.py")
#: a member of the watched group that ignores SIGTERM, like vLLM's engine core
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _a_pid_that_is_gone() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_watcher_whose_guard_died_before_it_armed_its_signal_still_stops_the_group():
    """The CI failure of 2026-12-06: under load the guard was SIGKILLed before its watcher child had armed its
    parent-death signal, the watcher took its new parent for the guard and never stopped the group. Here the watcher
    starts with a parent that is not the pid it was given (the guard), as it would find after that race."""
    watch = f"{sys.executable} -c {STUBBORN!r} & exec {sys.executable} {GUARD} --watch 1.0 {_a_pid_that_is_gone()}"
    shell = subprocess.Popen(["sh", "-c", watch], start_new_session=True)  # its group: the stubborn one + watcher
    try:
        deadline = time.monotonic() + 20
        while len(_group(shell.pid)) < 2 or not any("\x00import signal" in _cmdline(p) for p in _group(shell.pid)):
            assert time.monotonic() < deadline, f"the group did not start: {_group(shell.pid)}"
            time.sleep(0.05)
        assert shell.wait(timeout=20) == 0  # the watcher (exec'd in the shell's place) stopped the group and exited
        assert _wait_gone(shell.pid, within_s=5.0) < 5.0
    finally:
        for pid in _group(shell.pid):
            os.kill(pid, signal.SIGKILL)
        if shell.poll() is None:
            shell.kill()
            shell.wait()


def test_a_run_reaper_whose_driver_died_before_it_armed_its_signal_still_reaps():
    """The same race for the run reaper: its driver is gone before it starts watching, and it still kills what
    carries the run's marker."""
    marker = {**os.environ, "VIME_TEST_RUN": "race"}
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], env=marker, start_new_session=True)
    reaper = subprocess.Popen([sys.executable, GUARD, "--reap-run", "VIME_TEST_RUN", "race", "0.5",
                               str(_a_pid_that_is_gone())], start_new_session=True)  # fmt: skip
    try:
        assert reaper.wait(timeout=30) == 0
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        for proc in (child, reaper):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
