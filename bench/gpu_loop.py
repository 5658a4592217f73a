"""The GPU production loop's figures on this machine, in one table (issue 40's four rows and the step split): rollout
tokens/s of vime's default route against a bare vLLM returning log-probs; the training step inside ``vime run``
against ``bench/megatron_step.py`` on the same shapes, with MFU; the weight sync per step with the wake; and |Δlogp|
(engine vs trainer) on the GPU quickstart and the ~1B Llama, by default and in the deterministic opt-in mode. Prints
numbers as it goes (and ``--json``); asserts nothing. Sections run in order until ``--budget-s`` is spent; each
failure is printed and the next section runs.

    python3 bench/gpu_loop.py --build-1b /tmp/llama-1b     # once: the ~1B Llama with random weights (~20 s)
    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_loop.py [--sections a,b,...] [--json out.json] [--profile]

Sections (default order; rough seconds on one H100/H200 with warm compile caches, cold ones add ~1-2 min per model):

* ``throughput`` (~90 s): SmolLM2, ``--prompts`` × ``--max-tokens`` (256 × 256), one engine (CUDA graphs, bf16) and
  vllm-router: ``/v1/completions`` with and without ``logprobs: 0`` straight to the engine (the bare server), vime's
  default route through the router (before issue 40's change and now) and straight, ``/v1/completions`` through vime;
  API-server CPU per 1k tokens per shape; then the float32 LM head switched on in the same engine (its cost).
* ``run1b`` (~120 s): ``vime run``, the 1B, ``ipc``, 3 steps of 8 × (prompt + 1,024) tokens: step split, trainer split,
  weight sync split with the wake, MFU inside the loop, |Δlogp|.
* ``bench_train`` (~80 s): ``bench/megatron_step.py`` on the same 1B and shapes (8 and 16 × 1,124 tokens, 100 of
  them prompt; bshd and thd; ``--empty-cache`` as in the loop) — the bench column of the training row.
* ``bench_train_ray`` (~60 s): ``bench_train`` at 8 × 1,124 (bshd) inside a Ray worker placed as vime's trainer rank
  (``--in-ray``), and ``bench_train_beside`` (~90 s): the same while a vLLM engine of the 1B sleeps (level 2) on the
  GPU; ``bench_train_idle`` (~50 s): the bench idle for 2 s before each step, as the loop's trainer is through the
  rollout (a CPU that clocks down or loses its caches meanwhile). With ``run1b`` and ``bench_train`` they split the
  in-loop step's extra time between the Ray process, the sleeping engine's process on the GPU, the idle CPU and the
  loop itself (not in the default list).
* ``run135m`` (~90 s): the GPU quickstart (examples/gpu/quickstart.yaml, 3 steps): |Δlogp|, sync split.
* ``run1b_16`` (~120 s): as ``run1b`` with 16 samples a step.
* ``run1b_resident`` (~120 s): ``run1b`` with ``--no-offload-rollout --vllm-gpu-memory-utilization 0.3``: engine and
  trainer both resident (no sleep, no wake, no ``empty_cache``): what the offload costs the sync and the train step.
* ``throughput1b`` (~60 s): the 1B, 8 prompts × 1,024 tokens, bare with log-probs vs vime's default route.
* ``run135m_det`` (~90 s): the quickstart with ``--vllm-enable-deterministic-inference --deterministic-mode``:
  |Δlogp| and step time of the true-on-policy mode.
* ``throughput_det`` (~70 s): the engine in batch-invariant mode (``VLLM_BATCH_INVARIANT=1``): its tokens/s.
* ``run1b_thd`` (~120 s): ``run1b`` with packed micro-batches (``--qkv-format thd``).
* ``run1b_kv`` (~120 s): ``run1b`` with the engine's KV cache sized to the rollout (``--vllm-kv-cache-memory-bytes``,
  4 GiB) instead of 80 % of the free memory: what the KV cache's re-allocation at every wake costs the sync.
* ``run1b_gc`` (~120 s): ``run1b`` with ``--manual-gc`` (no garbage collection inside the train step).
* ``run1b_disk``, ``run135m_disk``: the ``disk`` weight sync (not in the default list).

Every ``vime run`` section also prints which processes used the CPU while the trainer was busy (:class:`CpuSampler`):
the 1B's step is bound by the trainer's CPU (its operators take more CPU time than GPU time), so what else runs on the
cores shows up in the train step; and the trainer process's threads (what shares its GIL), and the garbage
collections inside the train step (``perf/train_gc_time``).

``--profile`` adds one step to every ``vime run``, profiles its train step (``VIME_PROFILE_TRAIN_STEP``; left out of
the medians) and prints its top operators by GPU time, and prints ``bench_train``'s. MFU = 6 · parameters · prompt
and response tokens / seconds / the bf16 matmul peak ``bench_train`` measured (else ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM = Path.home() / ".cache" / "vime" / "models" / "smollm2-135m-instruct"
RESULTS: dict[str, dict] = {}
OUT = Path(os.environ.get("VIME_BENCH_DIR", "/tmp/vime-gpu-loop"))


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


def params_of(model: Path) -> float:
    """Parameters in ``model``'s safetensors files (a tied LM head counted once)."""
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


# -- rollout throughput -----------------------------------------------------------------------------------------------
def quickstart_prompts(model: Path, n: int) -> list[list[int]]:
    """``n`` chat prompts (token ids, ``model``'s chat template) from the quickstart's training data, cycled."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in (ROOT / "examples/quickstart/data/train.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        ids = tok.apply_chat_template(rows[i % len(rows)]["prompt"], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5: a BatchEncoding
    return out


async def _bare_no_logprobs(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits, trust_env=False) as http:

        async def one(p: list[int]) -> int:
            body = {"model": "policy", "prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
            resp = await http.post("/v1/completions", json=body)
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def throughput(name: str, model: Path, n: int, max_tokens: int, repeats: int, env: dict | None = None) -> None:
    """One engine as vime starts it (its worker extension; vLLM's defaults otherwise: CUDA graphs, bf16) and a
    router: every request shape of :mod:`bench.route_cost` (bare = ``/v1/completions`` straight to the engine),
    vime's routes through the router and straight; then with the float32 LM head switched on (its cost)."""
    from transformers import AutoTokenizer

    from bench.route_cost import api_server_pid, measure, run_shape
    from vime_core.engines.engine import VLLMServer
    from vime_core.engines.router import VLLMRouter

    prompts = quickstart_prompts(model, n)
    tok = AutoTokenizer.from_pretrained(str(model))
    out: dict = {"prompts": n, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    server = VLLMServer(
        model,
        served_model_name="policy",
        enforce_eager=False,
        dtype="bfloat16",
        extra_args=["--seed", "0", "--disable-uvicorn-access-log"],
        log_path=OUT / f"{name}-vllm.log",
        env=env,
    )
    server.start()
    try:
        server.wait_ready(900)
        router = VLLMRouter([server.url], policy="round_robin", log_path=OUT / f"{name}-router.log").start()
        try:
            router.wait_ready(120)
            out["start_s"] = time.perf_counter() - t0
            caps, pid = server.capabilities, api_server_pid(server.proc.pid)
            out["engine"] = caps.describe()
            t1 = time.perf_counter()
            n_bare = asyncio.run(_bare_no_logprobs(server.url, prompts, max_tokens))
            out["bare_no_logprobs_tok_s"] = n_bare / (time.perf_counter() - t1)
            direct = measure(server.url, pid, prompts, max_tokens, caps, tok, repeats, ("bare+logprobs", "generate"))
            routed = measure(
                router.url,
                pid,
                prompts,
                max_tokens,
                caps,
                tok,
                repeats,
                ("generate (before)", "generate", "completions"),
            )
            out["shapes"] = {
                **{f"{k} direct": v for k, v in direct.items()},
                **{f"{k} router": v for k, v in routed.items()},
            }
            bare = out["shapes"]["bare+logprobs direct"]["tok_s"]
            out["ratio_default_route"] = out["shapes"]["generate router"]["tok_s"] / bare
            out["ratio_before"] = out["shapes"]["generate (before) router"]["tok_s"] / bare
            report = server.collective_rpc("vime_fp32_lm_head", kwargs={"enable": True})
            out["fp32_lm_head"] = report
            fp32 = measure(router.url, pid, prompts, max_tokens, caps, tok, repeats, ("generate",))["generate"]
            out["fp32_lm_head_generate_router_tok_s"] = fp32["tok_s"]
            server.collective_rpc("vime_fp32_lm_head", kwargs={"enable": False})
            run_shape("generate", router.url, prompts[:2], 4, caps, tok)  # still serving after switching back
        finally:
            router.stop()
    finally:
        server.stop()
        wait_gpu_idle()
    RESULTS[f"throughput_{name}"] = out
    rows = "\n".join(
        f"    {k:26s} {v['tok_s']:9.0f} tok/s  {100 * v['tok_s'] / bare:6.1f}% of bare+logprobs  "
        f"server CPU {v['server_cpu_ms_per_1k']:6.0f} ms/1k tok  client CPU {v['client_cpu_ms_per_1k']:6.0f} ms/1k tok"
        for k, v in out["shapes"].items()
    )
    log(
        f"throughput {name} ({n} prompts x {max_tokens} tokens; {out['engine']}): bare without log-probs "
        f"{out['bare_no_logprobs_tok_s']:.0f} tok/s; vime's default route through the router = "
        f"{100 * out['ratio_default_route']:.1f}% of bare with log-probs (before: {100 * out['ratio_before']:.1f}%); "
        f"float32 LM head on: {out['fp32_lm_head_generate_router_tok_s']:.0f} tok/s ({report}); start "
        f"{out['start_s']:.0f} s\n{rows}"
    )


# -- vime runs --------------------------------------------------------------------------------------------------------
SPLIT_KEYS = (
    "perf/rollout_time",
    "perf/train_time",
    "perf/sync_time",
    "perf/step_time",
    "perf/sleep_time",
    "perf/sleep_level",
    "perf/wake_time",
    "perf/wake_weights_time",
    "perf/wake_kv_cache_time",
    "perf/train_compute_time",
    "perf/train_worker_time",
    "perf/train_transfer_time",
    "perf/train_setup_time",
    "perf/train_old_logprob_time",
    "perf/train_forward_time",
    "perf/train_backward_time",
    "perf/train_optimizer_time",
    "perf/empty_cache_time",
    "perf/host_copy_overlap_time",
    "perf/train_gc_time",
    "perf/train_gc_collections",
    "perf/train_gc_full_collections",
    "perf/train_cuda_mallocs",
    "weight_sync/host_copy_seconds",
    "weight_sync/trainer_seconds",
    "weight_sync/engine_seconds",
    "weight_sync/pause_seconds",
    "weight_sync/load_seconds",
    "weight_sync/label_seconds",
    "weight_sync/resume_seconds",
    "weight_sync/bytes",
    "train/num_tokens",
    "train/num_seq_tokens",
    "rollout/response_len_mean",
)


def vime_run(name: str, argv: list[str], env: dict[str, str], params: float | None, steps: int) -> None:
    """``vime run`` ``argv`` (plus the output dir and ``--num-rollout steps``) in a subprocess; the medians over steps
    1.. (step 0 holds first-call warm-ups) of :data:`SPLIT_KEYS`, |Δlogp| per step, MFU inside the loop."""
    out = OUT / f"run-{name}"
    subprocess.run(["rm", "-rf", str(out)], check=False)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    total = steps + 1 if ARGS.profile else steps  # the profiled step is one more, left out of the medians
    if ARGS.profile:
        full_env.update(VIME_PROFILE_TRAIN_STEP=str(steps), VIME_PROFILE_DIR=str(out / "profile"))
    cmd = [
        sys.executable,
        "-m",
        "vime_core.cli",
        "run",
        *argv,
        "--output-dir",
        str(out),
        "--num-rollout",
        str(total),
    ]
    t0 = time.perf_counter()
    with CpuSampler() as cpu:
        rc = run_until_metrics(cmd, full_env, OUT / f"run-{name}.log", out / "metrics.jsonl", total)
    metrics_file = out / "metrics.jsonl"
    lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
    if len(lines) < total:
        tail = (OUT / f"run-{name}.log").read_text()[-4000:]
        log(f"{name}: vime run failed ({rc}, {len(lines)} of {total} steps); last lines of run-{name}.log:\n{tail}")
        return
    m = [json.loads(line) for line in lines][:steps]
    later = m[1:] or m

    def med(key: str) -> float:
        vals = [r[key] for r in later if key in r]
        return statistics.median(vals) if vals else float("nan")

    res: dict = {k: med(k) for k in SPLIT_KEYS}
    res["logp_abs_diff"] = [round(r["train/train_rollout_logprob_abs_diff"], 5) for r in m]
    res["logp_abs_diff_mean"] = statistics.fmean(res["logp_abs_diff"])
    res["wall_s"] = time.perf_counter() - t0
    res["other_time"] = (
        res["perf/step_time"] - res["perf/rollout_time"] - res["perf/train_time"] - res["perf/sync_time"]
    )
    res["rollout_tok_s"] = res["train/num_tokens"] / res["perf/rollout_time"]
    res["cpu_while_training"] = cpu.report()
    if params:
        res["params"] = params
        set_mfu(res)
    RESULTS[name] = res
    split = ", ".join(
        f"{k.removeprefix('perf/train_').removesuffix('_time')} {res[k]:.3f}"
        for k in SPLIT_KEYS
        if k.startswith("perf/train_") and k not in ("perf/train_time", "perf/train_compute_time") and res[k] == res[k]
    )
    log(
        f"{name}: step {res['perf/step_time']:.2f} s = rollout {res['perf/rollout_time']:.2f} "
        f"({res['rollout_tok_s']:.0f} tok/s) + train {res['perf/train_time']:.3f} + sync {res['perf/sync_time']:.3f} "
        f"+ other {res['other_time']:.2f}\n"
        f"    train: trainer step {res['perf/train_compute_time']:.3f} s ({split}), empty_cache "
        f"{res['perf/empty_cache_time']:.3f}, host copy overlapping {res['perf/host_copy_overlap_time']:.3f} (copy "
        f"{res['weight_sync/host_copy_seconds']:.2f} s); garbage collection {res['perf/train_gc_time']:.3f} s "
        f"({res['perf/train_gc_collections']:.0f} collections, {res['perf/train_gc_full_collections']:.0f} full); "
        f"{res['perf/train_cuda_mallocs']:.0f} cudaMalloc calls; "
        f"{res['train/num_seq_tokens']:.0f} tokens"
        + (
            f"; MFU {100 * res['mfu_compute']:.1f}% (trainer step), {100 * res['mfu_train_time']:.1f}% (train time)"
            if params
            else ""
        )
        + f"\n    sync: sleep level {res['perf/sleep_level']:.0f} ({res['perf/sleep_time']:.3f} s before training), "
        f"wake "
        f"{res['perf/wake_time']:.3f} (weights {res['perf/wake_weights_time']:.3f}, kv cache "
        f"{res['perf/wake_kv_cache_time']:.3f}), trainer push {res['weight_sync/trainer_seconds']:.3f}, pause "
        f"{res['weight_sync/pause_seconds']:.3f}, transfer+load {res['weight_sync/load_seconds']:.3f}, reset+label "
        f"{res['weight_sync/label_seconds']:.3f}, resume {res['weight_sync/resume_seconds']:.3f} (engine side "
        f"{res['weight_sync/engine_seconds']:.3f}); {res['weight_sync/bytes'] / 1e6:.0f} MB\n"
        f"    |Δlogp| per step {res['logp_abs_diff']} (mean {res['logp_abs_diff_mean']:.4f})\n"
        f"    {res['cpu_while_training']}"
    )
    for f in sorted((out / "profile").glob("*.txt")) if ARGS.profile else ():
        log(f"{name}: {f}\n" + "\n".join(f.read_text().splitlines()[:45]))


def set_mfu(res: dict) -> None:
    """``mfu_compute`` (the trainer's step) and ``mfu_train_time`` (the driver's train time) of a run's medians:
    6 · parameters · prompt and response tokens / seconds / :func:`peak_tflops`."""
    flops = 6 * res["params"] * res["train/num_seq_tokens"]
    res["peak_tflops"] = peak = peak_tflops()
    res["mfu_compute"] = flops / res["perf/train_compute_time"] / (peak * 1e12)
    res["mfu_train_time"] = flops / res["perf/train_time"] / (peak * 1e12)


class CpuSampler:
    """Per-process CPU use while a ``vime run`` runs (``/proc/<pid>/stat`` utime + stime every ``interval_s``, in a
    thread), to show what shares the machine's cores with the trainer during its train steps: a sample interval
    counts as training when the trainer's process (``ray::TrainerWorker``) used more than half a core in it.
    :meth:`report` gives, over those intervals, each busy process's CPU in percent of one core."""

    def __init__(self, interval_s: float = 0.2, trainer: str = "TrainerWor") -> None:
        import threading

        self.interval_s = interval_s
        self.trainer = trainer  # in the trainer process's name (comm: Ray's "ray::TrainerWorker", cut at 15 bytes)
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _read_stat(path: Path) -> tuple[str, int] | None:
        """``(comm, utime + stime ticks)`` of a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` file, or
        ``None`` when it is gone (fields 14 and 15; ``comm`` may hold spaces and parentheses)."""
        try:
            stat = path.read_text()
        except OSError:
            return None
        rest = stat[stat.rindex(")") + 2 :].split()
        return stat[stat.index("(") + 1 : stat.rindex(")")], int(rest[11]) + int(rest[12])

    def _run(self) -> None:
        while not self._stop.is_set():
            now, ticks = time.monotonic(), {}
            for d in Path("/proc").iterdir():
                read = self._read_stat(d / "stat") if d.name.isdigit() else None
                if read is None:
                    continue
                comm, ticks[int(d.name)] = read
                self.names[int(d.name)] = comm  # the latest: Ray renames a worker when it becomes an actor
                if self.trainer in comm:  # and the trainer's threads, each: what shares its GIL and its core
                    for t in (d / "task").iterdir() if (d / "task").is_dir() else ():
                        if (tread := self._read_stat(t / "stat")) is not None:
                            ticks[-int(t.name)] = tread[1]
                            self.names[-int(t.name)] = f"{comm}/{tread[0]}"
            self.samples.append((now, ticks))
            self._stop.wait(self.interval_s)

    def report(self, top: int = 8) -> str:
        """The processes with the most CPU during the trainer's busy intervals (percent of one core), and how many
        such intervals there were."""
        hz = os.sysconf("SC_CLK_TCK")
        trainers = [pid for pid, name in self.names.items() if self.trainer in name and pid > 0]
        used: dict[int, float] = {}
        busy_s = 0.0
        for (t0, a), (t1, b) in itertools.pairwise(self.samples):
            dt = t1 - t0
            if not trainers or sum(b.get(p, 0) - a.get(p, 0) for p in trainers) / hz < 0.5 * dt:
                continue
            busy_s += dt
            for pid, ticks in b.items():
                if pid in a and ticks > a[pid]:
                    used[pid] = used.get(pid, 0.0) + (ticks - a[pid]) / hz
        if busy_s == 0:
            return "cpu: no interval with the trainer busy (no ray::TrainerWorker process seen)"
        rows = sorted(((p, v) for p, v in used.items() if p > 0), key=lambda kv: -kv[1])[:top]
        cells = ", ".join(f"{self.names[pid]}[{pid}] {100 * sec / busy_s:.0f}%" for pid, sec in rows)
        threads = sorted(((p, v) for p, v in used.items() if p < 0), key=lambda kv: -kv[1])[:top]
        tcells = ", ".join(f"{self.names[tid]}[{-tid}] {100 * sec / busy_s:.0f}%" for tid, sec in threads)
        return (
            f"cpu while the trainer is busy ({busy_s:.1f} s, {os.cpu_count()} cores): {cells}\n"
            f"    the trainer's threads (negative keys: thread ids): {tcells}"
        )


def run_until_metrics(cmd: list[str], env: dict, log_path: Path, metrics: Path, steps: int) -> int | None:
    """Run ``cmd`` (a ``vime run``) until ``metrics`` has ``steps`` lines, then SIGTERM it (vime stops what it
    started within seconds, skipping the final checkpoint the figures do not need) and wait until no process uses
    the GPU. :return: its exit code (143 after the SIGTERM), ``None`` if it had to be killed."""
    import signal

    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + ARGS.run_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        else:
            if proc.poll() is None:
                log(f"{cmd[4:6]}...: over --run-timeout {ARGS.run_timeout:g} s: SIGTERM")
                proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
    wait_gpu_idle()
    return rc


def wait_gpu_idle(timeout_s: float = 90.0) -> None:
    """Wait until ``nvidia-smi`` lists no compute process (the last run's engine and trainer are gone)."""
    query = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            busy = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.SubprocessError):
            return  # no nvidia-smi: nothing to wait for here
        if not busy:
            return
        time.sleep(1)
    log(f"processes still on the GPU after {timeout_s:g} s: {busy}")


def run_args(model: Path, samples: int, extra: list[str] = ()) -> list[str]:
    """The 1B's run (examples/gpu/throughput_1b.yaml) with ``samples`` samples a step (2 per prompt)."""
    return [
        *("--config", str(ROOT / "examples/gpu/throughput_1b.yaml"), "--model", str(model)),
        *("--rollout-batch-size", str(samples // 2), "--no-report"),
        *extra,
    ]


QUICKSTART = [
    *("--config", str(ROOT / "examples/gpu/quickstart.yaml"), "--no-report", "--no-save-hf"),
    *("--skip-eval-before-train", "--save-interval", "1000"),
]


def bench_train(model: Path, name: str = "bench_train", batches: str = "8,16", formats: str = "bshd,thd",
                extra: tuple[str, ...] = (), wait_idle: bool = True) -> None:  # fmt: skip
    """``bench/megatron_step.py`` on ``model`` at the loop's shapes (subprocess: its own GPU process); ``extra``:
    more of its flags (``--in-ray``); ``wait_idle``: wait for the GPU to have no process after it. Its figures go to
    ``RESULTS[name]``."""
    out = OUT / f"{name}.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench/megatron_step.py"),
        *("--model", str(model), "--batch", batches, "--micro-batch", "8", "--prompt-len", "100", "--seq", "1124"),
        *("--attention", "sdpa", "--qkv-format", formats, "--empty-cache", "--skip-checks"),
        *("--steps", "3", "--warmup", "1", "--json", str(out)),
        *(["--profile"] if ARGS.profile else []),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(OUT / f"{name}.log", "w") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=ARGS.run_timeout)
    if wait_idle:
        wait_gpu_idle()
    text = (OUT / f"{name}.log").read_text()
    if proc.returncode != 0 or not out.exists():
        log(f"{name} failed ({proc.returncode}):\n{text[-4000:]}")
        return
    RESULTS[name] = json.loads(out.read_text())
    log(f"{name}:\n" + "\n".join(line for line in text.splitlines() if "median step" in line or "profile" in line))


def bench_train_beside_engine(model: Path) -> None:
    """``bench_train`` (8 × 1,124, bshd) while a vLLM engine of ``model`` sleeps on the same GPU, as the colocated
    loop's engine does during the train step (``--enable-sleep-mode``, 0.5 of the memory, CUDA graphs, level-2
    sleep): what sharing the GPU with the sleeping engine's process costs the step, without Ray or the loop."""
    from vime_core.engines.engine import VLLMServer

    server = VLLMServer(
        model,
        served_model_name="policy",
        enforce_eager=False,
        dtype="bfloat16",
        extra_args=["--seed", "0", "--enable-sleep-mode", "--gpu-memory-utilization", "0.5"],
        log_path=OUT / "bench_train_beside-vllm.log",
    )
    server.start()
    try:
        server.wait_ready(900)
        server.sleep(level=2)
        bench_train(model, "bench_train_beside", batches="8", formats="bshd", wait_idle=False)
    finally:
        server.stop()
        wait_gpu_idle()


def peak_tflops() -> float:
    """The bf16 matmul peak ``bench_train`` measured on this GPU, else ``--peak-tflops``."""
    return float(RESULTS.get("bench_train", {}).get("peak_bf16_tflops") or ARGS.peak_tflops)


# -- the table --------------------------------------------------------------------------------------------------------
#: the bench sections of the row that splits the in-loop step's extra time, in its order
SPLIT_SECTIONS = ("bench_train", "bench_train_ray", "bench_train_beside", "bench_train_idle")


def table() -> str:
    """Issue 40's table from what ran (``—`` for what did not)."""

    def g(section: str, *keys, fmt="{:.3f}", scale=1.0) -> str:
        v = RESULTS.get(section)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return "—" if v is None or v != v else fmt.format(v * scale)

    def bench(fmt: str, n: int, key: str, scale: float = 1.0, section: str = "bench_train") -> str:
        r = RESULTS.get(section, {}).get(f"train_sdpa{'' if fmt == 'bshd' else '-' + fmt}_{n}x1124", {})
        v = r.get(key)
        return "—" if v is None else f"{v * scale:.3f}" if scale == 1.0 else f"{v * scale:.1f}%"

    split_steps = " / ".join(bench("bshd", 8, "step_s_median", section=s) for s in SPLIT_SECTIONS)
    split_mallocs = " / ".join(
        g(s, "train_sdpa_8x1124", "split", "perf/train_cuda_mallocs", fmt="{:.0f}") for s in SPLIT_SECTIONS
    )
    rows = [
        "| figure | measured | target |",
        "|---|---|---|",
        f"| rollout, SmolLM2 256 × 256: default route via router / bare with log-probs | "
        f"{g('throughput_135m', 'shapes', 'generate router', 'tok_s', fmt='{:.0f}')} / "
        f"{g('throughput_135m', 'shapes', 'bare+logprobs direct', 'tok_s', fmt='{:.0f}')} tok/s = "
        f"{g('throughput_135m', 'ratio_default_route', fmt='{:.1f}%', scale=100)} (before: "
        f"{g('throughput_135m', 'ratio_before', fmt='{:.1f}%', scale=100)}) | ≥ 97 % |",
        f"| rollout, 1B 8 × 1,024 | {g('throughput_1b', 'shapes', 'generate router', 'tok_s', fmt='{:.0f}')} / "
        f"{g('throughput_1b', 'shapes', 'bare+logprobs direct', 'tok_s', fmt='{:.0f}')} tok/s = "
        f"{g('throughput_1b', 'ratio_default_route', fmt='{:.1f}%', scale=100)} | ≥ 97 % |",
        f"| training 8 × 1,124 tokens: in loop (trainer step / train time) vs bench (bshd, thd) | "
        f"{g('run1b', 'perf/train_compute_time')} / {g('run1b', 'perf/train_time')} s vs "
        f"{bench('bshd', 8, 'step_s_median')}, {bench('thd', 8, 'step_s_median')} s; MFU "
        f"{g('run1b', 'mfu_compute', fmt='{:.1f}%', scale=100)} vs {bench('bshd', 8, 'mfu_6nt', 100)} | within 10 % |",
        f"| training 8 × 1,124, where the loop's extra time goes: bench / in a Ray worker / beside a sleeping engine "
        f"/ idle 2 s before each step / in the loop, with mallocs per step | {split_steps} / "
        f"{g('run1b', 'perf/train_compute_time')} s; mallocs {split_mallocs} / "
        f"{g('run1b', 'perf/train_cuda_mallocs', fmt='{:.0f}')} | within 10 % |",
        f"| training 16 × 1,124 tokens | {g('run1b_16', 'perf/train_compute_time')} / "
        f"{g('run1b_16', 'perf/train_time')} s vs {bench('bshd', 16, 'step_s_median')}, "
        f"{bench('thd', 16, 'step_s_median')} s; MFU {g('run1b_16', 'mfu_compute', fmt='{:.1f}%', scale=100)} vs "
        f"{bench('bshd', 16, 'mfu_6nt', 100)} | within 10 % |",
        f"| weight sync per step, 1B ipc, with the wake | {g('run1b', 'perf/sync_time')} s (wake "
        f"{g('run1b', 'perf/wake_time')}, engine side {g('run1b', 'weight_sync/engine_seconds')}; sleep "
        f"{g('run1b', 'perf/sleep_time')} before training); engine and trainer resident (--no-offload-rollout): "
        f"{g('run1b_resident', 'perf/sync_time')} s, trainer step {g('run1b_resident', 'perf/train_compute_time')} s; "
        f"KV cache sized to the rollout (4 GiB): {g('run1b_kv', 'perf/sync_time')} s (wake "
        f"{g('run1b_kv', 'perf/wake_time')}) | ≤ 0.15 s |",
        f"| mean \\|Δlogp\\| quickstart / 1B (default) | {g('run135m', 'logp_abs_diff_mean', fmt='{:.4f}')} / "
        f"{g('run1b', 'logp_abs_diff_mean', fmt='{:.4f}')} | ≤ 0.01 |",
        f"| mean \\|Δlogp\\| quickstart, deterministic mode | {g('run135m_det', 'logp_abs_diff_mean', fmt='{:.4f}')} "
        f"(step {g('run135m_det', 'perf/step_time')} s vs {g('run135m', 'perf/step_time')} s; batch-invariant engine "
        f"{g('throughput_det', 'shapes', 'generate router', 'tok_s', fmt='{:.0f}')} vs "
        f"{g('throughput_135m', 'shapes', 'generate router', 'tok_s', fmt='{:.0f}')} tok/s) | ≤ 1e-3 |",
    ]
    return "\n".join(rows)


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sections",
        default="throughput,run1b,bench_train,run135m,run1b_16,run1b_resident,throughput1b,run135m_det,"
        "throughput_det,run1b_thd",
    )
    p.add_argument("--budget-s", type=float, default=1800.0, help="start no section after this many seconds")
    p.add_argument("--run-timeout", type=float, default=480.0, help="seconds one vime run / bench may take")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="runs of each throughput shape (best kept)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak when bench_train did not measure it")
    p.add_argument("--model-1b", type=Path, default=Path("/tmp/llama-1b"))
    p.add_argument("--build-1b", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="profile one train step of every run and print the top")
    p.add_argument("--json", type=Path, default=None)
    ARGS = p.parse_args()
    if ARGS.build_1b:
        build_1b(ARGS.build_1b)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    one_b = ARGS.model_1b
    det = ["--vllm-enable-deterministic-inference", "--deterministic-mode"]
    sections = {
        "throughput": lambda: throughput("135m", SMOLLM, ARGS.prompts, ARGS.max_tokens, ARGS.repeats),
        "run1b": lambda: vime_run("run1b", run_args(build_1b(one_b), 8), {}, params_of(one_b), 3),
        "bench_train": lambda: bench_train(build_1b(one_b)),
        "bench_train_ray": lambda: bench_train(
            build_1b(one_b), "bench_train_ray", batches="8", formats="bshd", extra=("--in-ray",)
        ),
        "bench_train_beside": lambda: bench_train_beside_engine(build_1b(one_b)),
        "bench_train_idle": lambda: bench_train(
            build_1b(one_b), "bench_train_idle", batches="8", formats="bshd", extra=("--idle-between-steps", "2")
        ),
        "run135m": lambda: vime_run("run135m", QUICKSTART, {}, None, 3),
        "run1b_16": lambda: vime_run("run1b_16", run_args(build_1b(one_b), 16), {}, params_of(one_b), 3),
        "throughput1b": lambda: throughput("1b", build_1b(one_b), 8, 1024, ARGS.repeats),
        "run135m_det": lambda: vime_run("run135m_det", [*QUICKSTART, *det], {}, None, 3),
        "throughput_det": lambda: throughput(
            "det", SMOLLM, ARGS.prompts, ARGS.max_tokens, 1, env={"VLLM_BATCH_INVARIANT": "1"}
        ),
        "run1b_resident": lambda: vime_run(
            "run1b_resident",
            run_args(build_1b(one_b), 8, ["--no-offload-rollout", "--vllm-gpu-memory-utilization", "0.3"]),
            {},
            params_of(one_b),
            3,
        ),
        "run1b_thd": lambda: vime_run(
            "run1b_thd", run_args(build_1b(one_b), 8, ["--qkv-format", "thd"]), {}, params_of(one_b), 3
        ),
        "run1b_kv": lambda: vime_run(
            "run1b_kv",
            run_args(build_1b(one_b), 8, ["--vllm-kv-cache-memory-bytes", str(4 * 2**30)]),
            {},
            params_of(one_b),
            3,
        ),
        "run1b_gc": lambda: vime_run(
            "run1b_gc", run_args(build_1b(one_b), 8, ["--manual-gc"]), {}, params_of(one_b), 3
        ),
        "run1b_disk": lambda: vime_run(
            "run1b_disk", run_args(build_1b(one_b), 8, ["--weight-sync", "disk"]), {}, params_of(one_b), 3
        ),
        "run135m_disk": lambda: vime_run("run135m_disk", [*QUICKSTART, "--weight-sync", "disk"], {}, None, 3),
    }
    unknown = [s for s in ARGS.sections.split(",") if s not in sections]
    if unknown:
        p.error(f"--sections: unknown {unknown}; known: {', '.join(sections)}")
    for name in ARGS.sections.split(","):
        if time.perf_counter() - t0 > ARGS.budget_s:
            log(f"{name}: skipped (budget of {ARGS.budget_s:g} s spent)")
            continue
        s0 = time.perf_counter()
        try:
            sections[name]()
        except Exception as e:  # noqa: BLE001 - a bench reports and goes on
            log(f"{name}: failed: {e!r}")
        log(f"{name}: {time.perf_counter() - s0:.0f} s")
        if ARGS.json:
            ARGS.json.write_text(json.dumps(RESULTS, indent=1))
    for res in RESULTS.values():  # MFU against the peak bench_train measured, also for the runs before it
        if "params" in res and "train/num_seq_tokens" in res:  # a vime run's (bench_train's figures are its own)
            set_mfu(res)
    if ARGS.json:
        ARGS.json.write_text(json.dumps(RESULTS, indent=1))
    import torch

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    log(f"issue 40's table ({card}, torch {torch.__version__}):\n{table()}")
    log("results: " + json.dumps(RESULTS))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
