"""Rollout tokens/s for the quickstart model on this machine: through vime (router → engine) vs. direct to one
vLLM server vs. Hugging Face ``generate``. Prints numbers; asserts nothing.

    .venv/bin/python bench/rollout_throughput.py [--model smollm2-135m-instruct] [--prompts 32] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_core.models import resolve_model
    from vime_core.rollout.client import RouterClient
    from vime_core.rollout.engine import VLLMServer
    from vime_core.rollout.router import VLLMRouter

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=8, help="HF generate batch size")
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
    results = {}
    with VLLMServer(path, served_model_name="policy", extra_args=["--dtype", "float32"]) as server:
        server.wait_ready(600)
        with VLLMRouter([server.url]) as router:
            router.wait_ready(120)
            for name, url in (("vime (router → 1 engine)", router.url), ("direct to one vLLM server", server.url)):
                client = RouterClient(url, model="policy", timeout_s=600)
                loop = asyncio.new_event_loop()
                loop.run_until_complete(_drive(client, prompts[:4], 8, 4))  # warm-up
                n, dt = loop.run_until_complete(_drive(client, prompts, a.max_tokens, a.prompts))
                loop.run_until_complete(client.aclose())
                loop.close()
                results[name] = (n, dt)
                print(f"  {name:32s} {n:6d} tokens in {dt:7.2f} s = {n / dt:8.1f} tokens/s", flush=True)
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
    results[f"HF generate (batch {a.hf_batch})"] = (n_hf, time.perf_counter() - t0)
    print(f"  HF generate done: {n_hf} tokens", flush=True)
    print(
        f"\nrollout throughput: {a.model}, {a.prompts} prompts x {a.max_tokens} new tokens, fp32, "
        f"{torch.get_num_threads()} threads"
    )
    for name, (n, dt) in results.items():
        print(f"  {name:32s} {n:6d} tokens in {dt:7.2f} s = {n / dt:8.1f} tokens/s")


if __name__ == "__main__":
    main()
