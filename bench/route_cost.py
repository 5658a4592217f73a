"""What each way of asking one vLLM server for tokens and their log-probs costs: tokens/s, and CPU seconds per 1,000
generated tokens of the server's API process (where 0.24 builds per-token log-prob objects, detokenizes and, for a
plain ``/inference/v1/generate`` request, the cumulative output after every step) and of this client process
(JSON parsing, decoding text). Prints numbers; asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python bench/route_cost.py [--python .venv-vllm-0.24/bin/python] [--model DIR]
        [--prompts 64] [--max-tokens 128] [--repeats 2]

Shapes (all send token ids, ``temperature`` 1, ``ignore_eos``):

* ``bare+logprobs``: ``/v1/completions`` with ``logprobs: 0``, parsed with ``json`` (what ``bench/gpu_loop.py``
  calls a bare server returning log-probs);
* ``generate (before)``: vime's client on ``/inference/v1/generate`` as it asked before issue 40 (``lean=False``);
* ``generate``: vime's client now (``lean``: on 0.24 ``detokenize: false`` and ``output_kind`` FINAL_ONLY;
  answers decoded with msgspec into the fields the client reads);
* ``completions``: vime's client on ``/v1/completions``.

``bench/gpu_loop.py`` runs the same shapes on the GPU (:func:`measure`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("bare+logprobs", "generate (before)", "generate", "completions")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_server_pid(root_pid: int) -> int | None:
    """The pid of the process under ``root_pid`` (itself included) that runs vLLM's ``api_server`` module (vime
    starts it under a guard process), or ``None``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            argv = []
        if argv[1:3] == [b"-m", b"vllm.entrypoints.openai.api_server"]:  # not the guard that runs it
            return pid
        todo += children.get(pid, [])
    return None


async def _bare(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits, trust_env=False) as http:

        async def one(p: list[int]) -> int:
            body = {"model": "policy", "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
            resp = await http.post("/v1/completions", json={**body, "logprobs": 0})
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def _vime(url: str, prompts, max_tokens: int, caps, tok, api: str, lean: bool) -> int:
    from vime_core.engines.client import RouterClient

    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    async with RouterClient(url, "policy", 1200, capabilities=caps, tokenizer=tok, api=api, lean=lean) as c:
        outs = await asyncio.gather(*(c.generate(p, params) for p in prompts))
    return sum(len(o.token_ids) for o in outs)


def run_shape(shape: str, url: str, prompts, max_tokens: int, caps, tok) -> int:
    """Generate ``max_tokens`` for every prompt with ``shape`` (one of :data:`SHAPES`); the tokens generated."""
    if shape == "bare+logprobs":
        return asyncio.run(_bare(url, prompts, max_tokens))
    api = "completions" if shape == "completions" else "generate"
    return asyncio.run(_vime(url, prompts, max_tokens, caps, tok, api, lean=shape != "generate (before)"))


def measure(
    url: str, server_pid: int | None, prompts, max_tokens: int, caps, tok, repeats: int = 2, shapes=SHAPES
) -> dict[str, dict[str, float]]:
    """Each shape ``repeats`` times (interleaved, best tokens/s kept): ``{shape: {"tok_s", "server_cpu_ms_per_1k",
    "client_cpu_ms_per_1k"}}`` (CPU figures of the best run; ``server_pid``: the API server process, the one vLLM's
    ``api_server`` command runs in; ``None``: not measured)."""
    out: dict[str, dict[str, float]] = {}
    run_shape(shapes[0], url, prompts[:4], 8, caps, tok)  # warm-up (connections, first-request compilation)
    for _ in range(repeats):
        for shape in shapes:
            s0 = proc_cpu_seconds(server_pid) if server_pid else 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            n = run_shape(shape, url, prompts, max_tokens, caps, tok)
            dt, client = time.perf_counter() - t0, time.process_time() - c0
            server = (proc_cpu_seconds(server_pid) - s0) if server_pid else float("nan")
            row = {"tok_s": n / dt, "server_cpu_ms_per_1k": 1e6 * server / n, "client_cpu_ms_per_1k": 1e6 * client / n}
            if shape not in out or row["tok_s"] > out[shape]["tok_s"]:
                out[shape] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter whose vLLM serves")
    ap.add_argument("--model", type=Path, default=None, help="default: the tests' tiny model (built once)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from vime_core.engines.engine import VLLMServer

    model = a.model
    if model is None:
        from vime_core.testing.tiny_model import build_tiny_model

        model = build_tiny_model(Path("/tmp/vime-route-cost/tiny"), seed=0)
    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [tok(f"def f{i}(x):\n    return x * {i}\n")["input_ids"] for i in range(a.prompts)]
    server = VLLMServer(
        model,
        served_model_name="policy",
        dtype=a.dtype,
        python=a.python,
        omp_threads_bind="nobind",
        extra_args=["--seed", "0", "--max-num-seqs", str(max(a.prompts, 8))],
        log_path="/tmp/vime-route-cost/vllm.log",
    )
    server.start()
    try:
        server.wait_ready(900)
        print(f"{server.capabilities.describe()}; {a.prompts} prompts x {a.max_tokens} tokens", flush=True)
        pid = api_server_pid(server.proc.pid)
        res = measure(server.url, pid, prompts, a.max_tokens, server.capabilities, tok, a.repeats)
    finally:
        server.close()
    base = res["bare+logprobs"]["tok_s"]
    print(f"{'shape':20s} {'tok/s':>8s} {'of bare':>8s} {'server CPU ms/1k tok':>21s} {'client CPU ms/1k tok':>21s}")
    for shape, r in res.items():
        print(
            f"{shape:20s} {r['tok_s']:8.0f} {100 * r['tok_s'] / base:7.1f}% {r['server_cpu_ms_per_1k']:21.0f} "
            f"{r['client_cpu_ms_per_1k']:21.0f}"
        )
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
