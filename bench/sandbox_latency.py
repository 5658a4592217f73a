"""Sandbox latency per backend: create, one ``exec("echo hi")``, teardown — median (and min/max) of N rounds, in
milliseconds. Backends that cannot run here (no dockerd, no VM image) are reported as skipped with the reason.

    .venv/bin/python bench/sandbox_latency.py [--n 10] [--backends local,docker,localvm] [--concurrency 1]
        [--warmup 1]

``e2b`` without ``E2B_API_KEY`` runs against the local fake E2B service (:mod:`vime_sandbox_e2b.testing`) and is
printed as ``e2b-fake``: that is the SDK's and the plugin's overhead (HTTP + Connect RPC on 127.0.0.1) on top of a
``local`` sandbox, not E2B's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time


async def one_round(cls) -> tuple[float, float, float]:
    sb = cls.from_args(None)
    t0 = time.perf_counter()
    await sb.start()
    t1 = time.perf_counter()
    try:
        r = await sb.exec("echo hi", timeout=60)
        assert r.stdout == "hi\n", r
        t2 = time.perf_counter()
    finally:
        await sb.close()
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


async def bench(name: str, n: int, concurrency: int, warmup: int) -> dict:
    from vime_core.plugins.manager import get_plugins

    cls = get_plugins().resolve("sandbox", name)
    for _ in range(warmup):  # the first start of a process also runs the reaper
        await one_round(cls)
    rounds = []
    for _ in range(max(1, n // concurrency)):
        rounds += await asyncio.gather(*(one_round(cls) for _ in range(concurrency)))
    cols = list(zip(*rounds, strict=True))
    totals = [sum(r) for r in rounds]
    return {
        "create": statistics.median(cols[0]),
        "exec": statistics.median(cols[1]),
        "teardown": statistics.median(cols[2]),
        "total": statistics.median(totals),
        "min": min(totals),
        "max": max(totals),
        "n": len(rounds),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--backends", default="local,docker,localvm")
    ap.add_argument("--concurrency", type=int, default=1, help="sandboxes in flight at once")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    a = ap.parse_args()
    print(
        f"sandbox create + exec('echo hi') + teardown, median of N, ms (load average {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} CPUs, concurrency {a.concurrency})"
    )
    print(f"{'backend':10s} {'create':>8s} {'exec':>8s} {'teardown':>9s} {'total':>8s} {'min':>8s} {'max':>8s}  n")
    for name in [b for b in a.backends.split(",") if b]:
        fake = None
        try:
            if name == "e2b" and not os.environ.get("E2B_API_KEY"):
                from vime_sandbox_e2b.testing import FakeE2B

                fake = FakeE2B().__enter__()
                os.environ.update(fake.env())
            r = asyncio.run(bench(name, a.n, a.concurrency, a.warmup))
        except Exception as e:  # noqa: BLE001 - report and go on with the next backend
            print(f"{name:10s} skipped: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        finally:
            if fake is not None:
                fake.__exit__(None, None, None)
                for key in fake.env():
                    os.environ.pop(key, None)
        label = f"{name}-fake" if fake is not None else name
        print(
            f"{label:10s} {r['create']:8.0f} {r['exec']:8.0f} {r['teardown']:9.0f} {r['total']:8.0f} "
            f"{r['min']:8.0f} {r['max']:8.0f}  {r['n']}"
        )


if __name__ == "__main__":
    main()
