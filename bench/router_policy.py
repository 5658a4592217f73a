"""vllm-router policies for multi-turn / agent episodes on 2 engines: per-engine request split and prefix-cache hit
rate (from each engine's ``/metrics``). Prints numbers; asserts nothing.

Each episode is a session (``x-session-id`` header, as ``multi_turn`` and the agent gateway send it): a unique prompt
prefix, then ``--turns`` calls, each prompt = the previous prompt + the model's response + a tool result, so every
turn after the first can reuse the previous turn's KV cache — if it lands on the same engine. Episodes run
concurrently; the same workload is replayed for each policy (router restarted, prefix caches reset in between).

    .venv/bin/python bench/router_policy.py [--model tiny] [--episodes 8] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import tempfile
import time
from pathlib import Path

import httpx

POLICIES = ("round_robin", "consistent_hash", "sticky_least_loaded", "cache_aware")


def engine_counters(url: str) -> dict[str, float]:
    """``requests`` (finished), ``hits`` and ``queries`` (prefix-cache tokens) from an engine's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    out = {"requests": 0.0, "hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, value = m.group(1), float(m.group(3))
        if name == "vllm:request_success_total":
            out["requests"] += value
        elif name == "vllm:prefix_cache_hits_total":
            out["hits"] += value
        elif name == "vllm:prefix_cache_queries_total":
            out["queries"] += value
    return out


async def episodes(router_url: str, n: int, turns: int, prefix_len: int, resp_len: int, seed: int) -> float:
    from vime_core.engines.client import RouterClient

    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 4000) for _ in range(prefix_len)] for _ in range(n)]
    tools = [[[rng.randrange(100, 4000) for _ in range(24)] for _ in range(turns)] for _ in range(n)]
    params = {"temperature": 1.0, "max_tokens": resp_len, "ignore_eos": True, "seed": seed}

    async def one(i: int, client: RouterClient) -> None:
        ids = list(prefixes[i])
        for t in range(turns):
            out = await client.generate(ids, params, session_id=f"episode-{seed}-{i}")
            ids = ids + out.token_ids + tools[i][t]

    t0 = time.perf_counter()
    async with RouterClient(router_url, model="policy", timeout_s=600) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return time.perf_counter() - t0


def main() -> None:
    from vime_core.engines.engine import VLLMServer
    from vime_core.engines.router import VLLMRouter
    from vime_core.models import resolve_model
    from vime_core.testing.tiny_model import build_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="'tiny' (a random 2-layer Qwen2) or a vime model name / HF dir")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prefix-len", type=int, default=256, help="tokens of each episode's unique first prompt")
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vime-router-bench-"))
    path = build_tiny_model(tmp / "tiny") if a.model == "tiny" else resolve_model(a.model)
    engines = [
        VLLMServer(
            path,
            served_model_name="policy",
            enforce_eager=True,
            dtype="float32",
            kv_cache_space_gib=1.0,
            omp_threads_bind="nobind",
            log_path=tmp / f"engine_{i}.log",
            extra_args=["--enable-prefix-caching"],
        )
        for i in range(2)
    ]
    rows = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready(900)
        for seed, policy in enumerate(a.policies):
            for e in engines:
                e.reset_prefix_cache()
            before = [engine_counters(e.url) for e in engines]
            with VLLMRouter([e.url for e in engines], policy=policy, log_path=tmp / f"router_{policy}.log") as router:
                router.wait_ready(120)
                seconds = asyncio.run(
                    episodes(router.url, a.episodes, a.turns, a.prefix_len, a.response_len, seed=100 + seed)
                )
            after = [engine_counters(e.url) for e in engines]
            d = [{k: x[k] - y[k] for k in x} for x, y in zip(after, before, strict=True)]
            hits, queries = sum(x["hits"] for x in d), sum(x["queries"] for x in d)
            row = (policy, [int(x["requests"]) for x in d], hits / queries if queries else 0.0, seconds)
            rows.append(row)
            print(f"  {policy:20s} requests per engine {row[1]}  prefix-cache hit rate {row[2]:.3f}  {seconds:.1f} s")
    finally:
        for e in engines:
            e.stop()
    print(
        f"\nrouter policies: {a.episodes} episodes x {a.turns} turns on 2 engines ({a.model}), first prompt "
        f"{a.prefix_len} tokens, {a.response_len}-token responses + 24-token tool results per turn"
    )
    print(f"  {'policy':20s} {'requests/engine':>16s} {'prefix-cache hits':>18s} {'seconds':>8s}")
    for policy, split, rate, seconds in rows:
        print(f"  {policy:20s} {str(split):>16s} {rate:18.3f} {seconds:8.1f}")


if __name__ == "__main__":
    main()
