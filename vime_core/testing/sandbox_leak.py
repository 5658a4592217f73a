"""Leak check for sandbox backends: a child vime process opens N sandboxes, each running a command, and is killed
with SIGKILL; the caller then counts leftovers, runs the reaper and counts again.

``python -m vime_core.testing.sandbox_leak hold --backend NAME -n 20`` is the child (prints ``READY`` once every
sandbox runs its command, then waits to be killed); ``... once --backend NAME`` opens and closes one sandbox, which
reaps the leftovers of dead processes at its start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

from vime_core.plugins.manager import get_plugins
from vime_core.sandbox import SandboxLimits


def spawn_and_kill(
    backend: str,
    n: int = 20,
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    memory_mb: int | None = None,
) -> float:
    """Start the child holding ``n`` sandboxes of ``backend`` mid-command, SIGKILL it, and return the seconds it
    took until READY.

    :param memory_mb: memory limit of each sandbox, MiB (default: the backend's default limits).

    :raises RuntimeError: the child exited or did not get ready within ``timeout_s`` (its output included).
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vime_core.testing.sandbox_leak", "hold", "--backend", backend, "-n", str(n)]
        + (["--memory-mb", str(memory_mb)] if memory_mb else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    lines = []
    try:
        while True:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"leak child not ready after {timeout_s} s:\n" + "".join(lines[-30:]))
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"leak child exited ({proc.wait()}):\n" + "".join(lines[-30:]))
            lines.append(line)
            if line.strip() == "READY":
                break
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def run_once(backend: str, *, timeout_s: float = 600.0, env: dict[str, str] | None = None) -> str:
    """Open and close one sandbox of ``backend`` in a fresh process (its start reaps leftovers); returns its output.

    :raises RuntimeError: the process failed.
    """
    out = subprocess.run(
        [sys.executable, "-m", "vime_core.testing.sandbox_leak", "once", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    if out.returncode != 0:
        raise RuntimeError(f"sandbox_leak once failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


async def _hold(backend: str, n: int, memory_mb: int | None) -> None:
    cls = get_plugins().resolve("sandbox", backend)
    kwargs = {"limits": SandboxLimits(memory_bytes=memory_mb << 20)} if memory_mb else {}
    boxes = [cls.from_config(**kwargs) for _ in range(n)]
    await asyncio.gather(*(b.start() for b in boxes))
    tasks = [asyncio.ensure_future(b.exec("echo $$ > running; sleep 600", timeout=3600)) for b in boxes]
    for b in boxes:  # every command is running
        for _ in range(600):
            r = await b.exec("test -f running", timeout=60)
            if r.exit_code == 0:
                break
            await asyncio.sleep(0.1)
    print("READY", flush=True)
    await asyncio.gather(*tasks)


async def _once(backend: str) -> None:
    cls = get_plugins().resolve("sandbox", backend)
    async with cls.from_config() as sb:
        r = await sb.exec("echo ok", timeout=60)
        print(r.stdout.strip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m vime_core.testing.sandbox_leak")
    p.add_argument("action", choices=["hold", "once"])
    p.add_argument("--backend", required=True)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("--memory-mb", type=int, default=None)
    a = p.parse_args(argv)
    asyncio.run(_hold(a.backend, a.n, a.memory_mb) if a.action == "hold" else _once(a.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
