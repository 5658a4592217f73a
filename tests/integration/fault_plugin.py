"""Fault injection for ``test_fault_injection.py``, loaded by ``vime run`` through dotted paths.

It runs inside the rollout manager (a Ray actor) and reads its plan from the JSON file named by the environment
variable ``VIME_FAULT_PLAN``::

    {"model": DIR, "log": FILE, "kill_engine_rollout_step": 1, "wait_all_step": 2, "kill_engine_sync_version": 3,
     "raise_reward_step": 3, "kill_router_step": 4}

* :func:`generate` (``--generate``): in the rollout of ``kill_engine_rollout_step`` the last sample of the batch
  (the step's last generate call) first SIGKILLs the process group of the engine with the lowest port (vime's
  process guard, the vLLM API server and its engine core) while the batch's other requests are in flight there:
  the first generate call of that step pauses the engine (``/pause?mode=keep``), so the requests routed to it wait
  in it until the kill, 1 s after the last request was sent. In the rollout of ``kill_router_step`` it SIGKILLs the
  router's process group. Then it generates with vime's default generate function.
* :class:`FaultyDiskDeltaWeightSync` (``--weight-sync``): ``disk-delta``, except that while applying version
  ``kill_engine_sync_version`` (the engines paused) it SIGKILLs the engine with the highest port just before
  loading into it. Its replacement then needs the full current version, after which the deltas resume.
* :func:`reward` (``--reward``): ``digit_fraction``, except that the second reward call of ``raise_reward_step``
  raises.

In the rollouts of ``wait_all_step`` (before the sync kill) and ``kill_router_step`` the last sample first waits
until the router lists both engines again, so each fault meets a recovered system and every recovery is timed on
its own. Every injected fault is appended to ``log`` as a JSON line
``{"fault", "time", "pid", ...}`` (wall-clock seconds), which the test pairs with ``logs/health_events.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from vime_core.plugins.manager import get_plugins
from vime_core.rollout.context import get_rollout_context
from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync

_done: set[str] = set()
_calls: dict[tuple[str, int], int] = {}
_victim: dict[str, int] = {}


def plan() -> dict[str, Any]:
    """The fault plan (``VIME_FAULT_PLAN``)."""
    return json.loads(Path(os.environ["VIME_FAULT_PLAN"]).read_text())


def _log(fault: str, **fields: Any) -> None:
    with open(plan()["log"], "a") as f:
        f.write(json.dumps({"fault": fault, "time": time.time(), **fields}) + "\n")


def _pids(*needles: str) -> list[tuple[int, str]]:
    """``(pid, cmdline)`` of this machine's processes whose command line contains every needle."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles):
            found.append((int(entry.name), cmd))
    return found


def _listener_pid(port: int) -> int:
    """The pid of the process listening on TCP ``port`` (from ``/proc/net/tcp*`` and ``/proc/<pid>/fd``; the router
    renames its process title, so its command line cannot be matched)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")


def _engine_pid(port: int) -> int:
    """The pid of the process group leader of the vLLM API server on ``port``: the server runs under vime's process
    guard (``vime_core/engines/process_guard.py``), which leads the group; the guard's own command line carries the
    server's, so exactly one of the two matches is the server."""
    model = plan()["model"]
    hits = _pids("vllm.entrypoints.openai.api_server", f"--model {model} ", f"--port {port} ")
    servers = [pid for pid, cmd in hits if "process_guard.py" not in cmd]
    assert len(servers) == 1, f"expected one vLLM API server on port {port} serving {model}, found {hits}"
    return os.getpgid(servers[0])


def _kill_group(pgid: int) -> None:
    os.killpg(pgid, signal.SIGKILL)  # the guard, the server, its engine core and workers


async def _wait_all_workers(router_url: str, n: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        while time.monotonic() < deadline:
            try:
                if len((await http.get(f"{router_url}/list_workers")).json().get("urls", [])) >= n:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the router {router_url} did not list {n} workers within {timeout_s:.0f} s")


def _router_url() -> str:
    """The run's router URL, from the plugin call's context."""
    return get_rollout_context().client.base_url


def _engine_ports(router_url: str | None = None) -> list[int]:
    """The ports of this run's engines, sorted, as the router at ``router_url`` (default: the plugin call's) lists
    them. Not from the process table: another vLLM server serving the same model on this machine (the test
    session's shared one) must never be a victim."""
    router_url = router_url or _router_url()
    urls = httpx.get(f"{router_url}/list_workers", timeout=30, trust_env=False).json().get("urls", [])
    return sorted(int(u.rstrip("/").rsplit(":", 1)[1]) for u in urls)


def _call(what: str, step: int) -> int:
    """How many times ``what`` was called in ``step`` so far, this call included."""
    _calls[(what, step)] = _calls.get((what, step), 0) + 1
    return _calls[(what, step)]


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """vime's default generate function, with the rollout faults of the plan (see the module docstring)."""
    p = plan()
    step = get_rollout_context().weight_version  # sync loop: step k generates with weight version k
    call = _call("generate", step)
    if step == p["kill_engine_rollout_step"] and call == 1:  # requests routed to the victim wait there from now
        port = _engine_ports()[0]
        httpx.post(f"http://127.0.0.1:{port}/pause", params={"mode": "keep"}, timeout=30, trust_env=False)
        _victim["port"] = port
    if call == args.rollout_batch_size * args.n_samples_per_prompt:  # the step's last sample
        router_url = _router_url()
        if step == p["kill_engine_rollout_step"] and "engine_rollout" not in _done:
            _done.add("engine_rollout")
            await asyncio.sleep(1.0)  # the batch's other requests reach the engines
            port = _victim["port"]
            pid = _engine_pid(port)
            _kill_group(pid)
            _log("engine_kill_rollout", pid=pid, url=f"http://127.0.0.1:{port}", step=step)
        if step in (p["wait_all_step"], p["kill_router_step"]):
            await _wait_all_workers(router_url, 2)
        if step == p["kill_router_step"] and "router" not in _done:
            _done.add("router")
            pid = _listener_pid(int(router_url.rsplit(":", 1)[1]))
            _kill_group(os.getpgid(pid))  # the router runs in its own session
            _log("router_kill", pid=pid, url=router_url, step=step)
    default = get_plugins().resolve("generate", "default")
    return await default(args, sample, sampling_params)


async def reward(args: Any, sample: Any) -> Any:
    """``digit_fraction``, raising for the second reward call of the plan's ``raise_reward_step``."""
    step = get_rollout_context().weight_version
    if _call("reward", step) == 2 and step == plan()["raise_reward_step"]:
        _log("reward_raise", step=step)
        raise RuntimeError("injected reward failure")
    return await get_plugins().resolve("reward", "digit_fraction")(args, sample)


class FaultyDiskDeltaWeightSync(DiskDeltaWeightSync):
    """``disk-delta`` weight sync that kills an engine while applying the plan's ``kill_engine_sync_version``."""

    def apply(self, engine: Any, update: Any, timeout_s: float) -> None:
        p = plan()
        ports = _engine_ports(self.engines.client.base_url)  # the rollout side's engines, set by its fleet
        if update.version == p["kill_engine_sync_version"] and "engine_sync" not in _done and engine.port == ports[-1]:
            _done.add("engine_sync")
            pid = _engine_pid(engine.port)
            _kill_group(pid)
            _log("engine_kill_sync", pid=pid, url=engine.url, version=update.version)
        super().apply(engine, update, timeout_s)
