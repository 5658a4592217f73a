"""The GPU production loop's figures on this machine, in one table: rollout tokens/s through vime (router → engine)
vs a bare ``vllm serve`` of the same model, and short ``vime run``s (Megatron + colocated CUDA vLLM engine) that give
the weight sync per step split into its phases, the step time split, the training MFU inside the loop and |Δlogp|
(engine vs trainer) with the default bf16 engine, an fp32 engine and vLLM's batch-invariant mode. Prints numbers
as it goes (and ``--json``); asserts nothing. Sections run in order until ``--budget-s`` is spent.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_loop.py [--sections throughput,run135m,...] [--json out.json]
    python3 bench/gpu_loop.py --build-1b DIR      # the ~1B Llama-shaped model with random weights (speed only)

Sections: ``throughput`` (SmolLM2, ``--prompts`` × ``--max-tokens``, CUDA graphs on, as users serve),
``run135m`` (ipc), ``run135m_disk``, ``logp_fp32`` (``--vllm-dtype float32``), ``logp_batch_invariant``
(``VLLM_BATCH_INVARIANT=1``), ``run1b`` (ipc, 8 × ~1,100-token sequences: the shape of bench/megatron_step.py),
``run1b_disk``, ``throughput1b``. MFU = 6 · parameters · trained tokens / train seconds / ``--peak-tflops``
(790: the bf16 matmul peak measured on an H200; docs/gpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM = Path.home() / ".cache" / "vime" / "models" / "smollm2-135m-instruct"
RESULTS: dict[str, dict] = {}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_1b(out: Path, tokenizer_dir: Path = SMOLLM) -> Path:
    """A random ~1.0B Llama (bf16) with SmolLM2's tokenizer in ``out`` (once)."""
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    log(f"built {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B-parameter Llama in {out}")
    return out


# -- throughput -------------------------------------------------------------------------------------------------------
async def _drive_completions(
    url: str, prompts: list[list[int]], max_tokens: int, logprobs: bool = False
) -> tuple[int, float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=httpx.Limits(max_connections=1024)) as http:

        async def one(p: list[int]) -> int:
            body = {"model": "policy", "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
            if logprobs:  # what RL needs from every token: the sampled token's log-prob
                body["logprobs"] = 0
            resp = await http.post("/v1/completions", json=body)
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - t0


async def _drive_vime(client, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def _prompts(model: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in (ROOT / "examples/quickstart/data/train.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        ids = tok.apply_chat_template(rows[i % len(rows)]["prompt"], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5: a BatchEncoding
    return out


def throughput(name: str, model: Path, n: int, max_tokens: int, repeats: int = 2) -> None:
    """Bare ``vllm.entrypoints.openai.api_server`` (vLLM's defaults, bf16) vs vime's engine + router + client."""
    import httpx

    from vime_core.net import find_free_port
    from vime_core.rollout.client import RouterClient
    from vime_core.rollout.engine import VLLMServer
    from vime_core.rollout.router import VLLMRouter

    prompts = _prompts(model, n)
    out: dict[str, float] = {}
    port = find_free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "policy", "--seed", "0"]
    t0 = time.perf_counter()
    logf = open(f"/tmp/bench-bare-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"bare vLLM exited: see /tmp/bench-bare-{name}.log")
            time.sleep(1)
        out["bare_start_s"] = time.perf_counter() - t0
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_drive_completions(url, prompts[:8], 16))  # warm-up
        runs = [asyncio.run(_drive_completions(url, prompts, max_tokens)) for _ in range(repeats)]
        out["bare_tok_s"] = max(t / s for t, s in runs)
        runs = [asyncio.run(_drive_completions(url, prompts, max_tokens, logprobs=True)) for _ in range(repeats)]
        out["bare_logprobs_tok_s"] = max(t / s for t, s in runs)  # what RL needs: each sampled token's log-prob
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)
    t0 = time.perf_counter()
    server = VLLMServer(
        model,
        served_model_name="policy",
        enforce_eager=False,
        dtype="bfloat16",
        extra_args=["--seed", "0"],
        log_path=f"/tmp/bench-vime-{name}.log",
    )
    server.start()
    try:
        server.wait_ready(900)
        router = VLLMRouter([server.url], policy="round_robin", log_path=f"/tmp/bench-router-{name}.log").start()
        try:
            router.wait_ready(120)
            out["vime_start_s"] = time.perf_counter() - t0
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model))

            async def go(base, ps, mt, api="auto"):
                caps = server.capabilities
                async with RouterClient(base, "policy", capabilities=caps, tokenizer=tok, api=api) as c:
                    return await _drive_vime(c, ps, mt)

            asyncio.run(go(router.url, prompts[:8], 16))
            runs = [asyncio.run(go(router.url, prompts, max_tokens)) for _ in range(repeats)]
            out["vime_tok_s"] = max(t / s for t, s in runs)
            runs = [asyncio.run(go(server.url, prompts, max_tokens)) for _ in range(repeats)]
            out["vime_no_router_tok_s"] = max(t / s for t, s in runs)  # the router's share of the gap
            runs = [asyncio.run(go(router.url, prompts, max_tokens, "completions")) for _ in range(repeats)]
            out["vime_completions_tok_s"] = max(t / s for t, s in runs)  # log-probs as a float list, not objects
        finally:
            router.stop()
    finally:
        server.stop()
    out["ratio"] = out["vime_tok_s"] / out["bare_tok_s"]
    out["ratio_logprobs"] = out["vime_tok_s"] / out["bare_logprobs_tok_s"]
    RESULTS[f"throughput_{name}"] = out
    log(
        f"throughput {name} ({n} prompts × {max_tokens} tokens): bare vLLM {out['bare_tok_s']:.0f} tok/s "
        f"({out['bare_logprobs_tok_s']:.0f} with log-probs); vime {out['vime_tok_s']:.0f} tok/s through the router "
        f"({out['vime_no_router_tok_s']:.0f} direct, {out['vime_completions_tok_s']:.0f} on /v1/completions) = "
        f"{100 * out['ratio']:.1f}% of bare "
        f"({100 * out['ratio_logprobs']:.1f}% of bare with log-probs); starts {out['bare_start_s']:.0f} s / "
        f"{out['vime_start_s']:.0f} s"
    )


# -- vime runs --------------------------------------------------------------------------------------------------------
def vime_run(
    name: str,
    model: Path,
    weight_sync: str,
    steps: int,
    extra: list[str],
    env: dict[str, str],
    params: float | None = None,
) -> None:
    out = Path(f"/tmp/bench-run-{name}")
    subprocess.run(["rm", "-rf", str(out)], check=False)
    argv = [
        *("run", "--model", str(model), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "1", "--weight-sync", weight_sync, "--num-rollout", str(steps)),
        *("--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl"), "--no-report", "--no-save-hf"),
        *("--reward", "tests.integration.text_reward.text_length_mod3", "--lr", "1e-5"),
        *extra,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=900,
    )
    if proc.returncode != 0:
        log(f"{name}: vime run failed ({proc.returncode}): {proc.stdout[-1500:]} {proc.stderr[-3000:]}")
        return
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = m[1:] or m  # step 0 includes first-call warm-ups

    def med(key: str) -> float:
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else float("nan")

    res = {
        k: med(k)
        for k in (
            "perf/rollout_time",
            "perf/train_time",
            "perf/sync_time",
            "perf/step_time",
            "perf/sleep_time",
            "perf/wake_time",
            "weight_sync/trainer_seconds",
            "weight_sync/engine_seconds",
            "weight_sync/pause_seconds",
            "weight_sync/load_seconds",
            "weight_sync/label_seconds",
            "weight_sync/resume_seconds",
            "weight_sync/bytes",
            "train/num_tokens",
            "rollout/response_len_mean",
        )
    }
    res["logp_abs_diff"] = [round(r["train/train_rollout_logprob_abs_diff"], 5) for r in m]
    res["wall_s"] = time.perf_counter() - t0
    other = res["perf/step_time"] - res["perf/rollout_time"] - res["perf/train_time"] - res["perf/sync_time"]
    res["other_time"] = other
    if params:
        res["mfu"] = 6 * params * res["train/num_tokens"] / res["perf/train_time"] / (ARGS.peak_tflops * 1e12)
    RESULTS[name] = res
    log(
        f"{name}: step {res['perf/step_time']:.2f} s = rollout {res['perf/rollout_time']:.2f} + train "
        f"{res['perf/train_time']:.2f} + sync {res['perf/sync_time']:.3f} + other {other:.2f}; sync: trainer push "
        f"{res['weight_sync/trainer_seconds']:.3f}, pause {res['weight_sync/pause_seconds']:.3f}, transfer+load "
        f"{res['weight_sync/load_seconds']:.3f}, reset+label {res['weight_sync/label_seconds']:.3f}, resume "
        f"{res['weight_sync/resume_seconds']:.3f} (engine side {res['weight_sync/engine_seconds']:.3f}), wake "
        f"{res['perf/wake_time']:.3f}, sleep {res['perf/sleep_time']:.3f}; {res['weight_sync/bytes'] / 1e6:.0f} MB; "
        f"|Δlogp| per step {res['logp_abs_diff']}" + (f"; MFU {100 * res['mfu']:.1f}%" if params else "")
    )


SMALL = [
    "--rollout-batch-size",
    "8",
    "--n-samples-per-prompt",
    "4",
    "--rollout-max-response-len",
    "64",
    "--micro-batch-size",
    "32",
]
BIG = [
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--rollout-max-response-len",
    "1024",
    "--micro-batch-size",
    "8",
    "--rollout-temperature",
    "1.0",
]


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sections",
        default="throughput,run135m,run1b,logp_fp32,logp_batch_invariant,run135m_disk,run1b_disk,throughput1b",
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="start no section after this many seconds")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--model-1b", type=Path, default=Path("/tmp/llama-1b"))
    p.add_argument("--build-1b", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    ARGS = p.parse_args()
    if ARGS.build_1b:
        build_1b(ARGS.build_1b)
        return
    t0 = time.perf_counter()
    n135 = 134_515_008  # SmolLM2-135M (tied embeddings counted once)
    sections = {
        "throughput": lambda: throughput("135m", SMOLLM, ARGS.prompts, ARGS.max_tokens),
        "run135m": lambda: vime_run("run135m", SMOLLM, "ipc", 4, SMALL, {}, n135),
        "run135m_disk": lambda: vime_run("run135m_disk", SMOLLM, "disk", 3, SMALL, {}, n135),
        "logp_fp32": lambda: vime_run("logp_fp32", SMOLLM, "ipc", 3, [*SMALL, "--vllm-dtype", "float32"], {}),
        "logp_batch_invariant": lambda: vime_run(
            "logp_batch_invariant", SMOLLM, "ipc", 3, SMALL, {"VLLM_BATCH_INVARIANT": "1"}
        ),
        "run1b": lambda: vime_run("run1b", build_1b(ARGS.model_1b), "ipc", 3, BIG, {}, _params(ARGS.model_1b)),
        "run1b_disk": lambda: vime_run("run1b_disk", build_1b(ARGS.model_1b), "disk", 3, BIG, {}),
        "throughput1b": lambda: throughput("1b", build_1b(ARGS.model_1b), ARGS.prompts, ARGS.max_tokens, 1),
    }
    for name in ARGS.sections.split(","):
        if time.perf_counter() - t0 > ARGS.budget_s:
            log(f"{name}: skipped (budget of {ARGS.budget_s:g} s spent)")
            continue
        try:
            sections[name]()
        except Exception as e:  # noqa: BLE001 - a bench reports and goes on
            log(f"{name}: failed: {e!r}")
        if ARGS.json:
            ARGS.json.write_text(json.dumps(RESULTS, indent=1))
    log("results: " + json.dumps(RESULTS))


def _params(model: Path) -> float:
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118
                size = 1
                for d in st.get_slice(k).get_shape():
                    size *= d
                n += size
    return float(n)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
