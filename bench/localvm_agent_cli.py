"""How the prepared agent CLIs reach a localvm sandbox: the read-only 9p share at ``/opt/vime/agents`` against a copy
into the VM's ``/tmp`` (what the harness did before). Prints seconds for: the VM boot (to SSH), the harness's
``install`` (find + ``claude --version``) through the share, a second ``claude --version`` (page cache warm), and,
with ``--copy``, ``install`` in a VM booted without the share (the 245 MB executable written over SSH).

    .venv/bin/python bench/localvm_agent_cli.py [--agent claude-code] [--copy] [--memory-mb 2048]

Needs the base image (``vime-sandbox-localvm build-image``, format ≥ 2) and ``vime agent prepare <agent>``; boots one
VM (two with ``--copy``): run it when no other heavy job runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def one(agent: str, share: bool, memory_mb: int) -> dict[str, float | str]:
    from vime_sandbox_localvm.sandbox import LocalVMSandbox

    from vime_core.plugins.manager import get_plugins
    from vime_core.sandbox import SandboxLimits

    harness = get_plugins().resolve("agent", agent)()
    harness.prepare(log=lambda *a: None)
    sb = LocalVMSandbox(
        limits=SandboxLimits(memory_bytes=memory_mb << 20, wall_time_s=None), agents_dir=None if share else False
    )
    t0 = time.perf_counter()
    await sb.start()
    out: dict[str, float | str] = {"boot_s": time.perf_counter() - t0, "accel": sb._accel()}
    try:
        t1 = time.perf_counter()
        await harness.install(sb)
        out["install_s"] = time.perf_counter() - t1
        out["executable"] = harness.executable(sb)
        t2 = time.perf_counter()
        r = await sb.exec([harness.executable(sb), "--version"], timeout=600)
        out["version_again_s"] = time.perf_counter() - t2
        out["version"] = r.stdout.strip()
    finally:
        await sb.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agent", default="claude-code")
    p.add_argument("--copy", action="store_true", help="also time the copy into a VM without the share")
    p.add_argument("--memory-mb", type=int, default=2048)
    a = p.parse_args()
    modes = [True, False] if a.copy else [True]
    for share in modes:
        r = asyncio.run(one(a.agent, share, a.memory_mb))
        print(
            f"{a.agent} via {'9p share' if share else 'copy    '}: boot {r['boot_s']:.1f} s ({r['accel']}), "
            f"install {r['install_s']:.1f} s, --version again {r['version_again_s']:.1f} s "
            f"[{r['version']}] at {r['executable']}"
        )


if __name__ == "__main__":
    main()
