"""Two GPUs: the megatron backend with tensor parallelism 2, and NCCL weight broadcast into vime's receive code.

Run with ``python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/megatron_x2.py`` (megatron-core
on ``PYTHONPATH``, see bench/megatron_step.py). Rank 0 prints:

A. TP=2 on small random Llama (GQA, vocabulary 1001: padded to 1002 and masked) and Qwen2 (q/k/v biases, tied
   embeddings; sequence parallel where TE exists) models: HF → Megatron (sharded) → HF round trip bit-exact or not,
   max |log-prob|
   difference to Hugging Face fp32 (and HF bf16's own), and whether 3 RL steps with a positive advantage raise the
   log-probs of the trained tokens.
B. NCCL weight sync: the TP-gathered HF tensors of the trained model broadcast from rank 0 in buckets
   (:func:`vime_core.weight_sync.nccl.broadcast_weights`, xxh3-128 digests attached) into rank 1 running the
   engine-side :func:`vime_core.weight_sync.nccl.receive_weights`; bit-exact or not; then the ~1B model's bf16
   tensors (1.9 GB) without digests: bytes, seconds, GB/s.
C. The ~1B Llama-shaped model (bench/megatron_step.py's) trained with each ``--layouts`` entry (TP=2; TP=1 = data
   parallelism over the two ranks, each training on its half of the 16-sample global batch): median step time and
   MFU per GPU; with ``--baseline`` (the JSON of a one-process TP=1 run) the ratio of each to the one-GPU MFU::

    OUT=/tmp/x1 python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/megatron_x2.py \
        --phases C --layouts tp1
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/megatron_x2.py --phases C \
        --layouts tp2,tp1 --baseline /tmp/x1/megatron_x1.json

   One H200, megatron-core 0.16.1, SDPA, no TE, the one-GPU TP=1 baseline: 0.278 s per 16 × 1024-token step, 336
   TFLOP/s (6·N·tokens), MFU 0.42 of a measured 797 TFLOP/s peak. Two H200s (2026-12-01): TP=2 0.212 s,
   MFU 0.281 per GPU (0.67 of one GPU's); DP=2 0.169 s, MFU 0.361 per GPU (0.86); that session's one-GPU
   baseline 0.277 s, MFU 0.434.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


def log(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def args_for(tp: int, sp: bool = False, lr: float = 1e-3) -> argparse.Namespace:
    from vime_core.testing.trainer_args import trainer_args

    return trainer_args(lr=lr, tensor_model_parallel_size=tp, sequence_parallel=sp)


def small_model(out: Path, family: str) -> Path:
    import transformers

    torch.manual_seed(0)
    common = dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.1,
        max_position_embeddings=1024,
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=1001, tie_word_embeddings=False, **common)
        )
    else:
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(vocab_size=1000, tie_word_embeddings=True, **common)
        )
    model.to(torch.bfloat16).save_pretrained(str(out))
    return out


def phase_a(work: Path, res: dict):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import token_log_probs
    from vime_core.config import RunConfig
    from vime_core.testing.contracts import TrainerBackendContract
    from vime_core.trainer.megatron_backend import MegatronTrainer, have_transformer_engine

    trainer = None
    for family, sp in (("llama", False), ("qwen2", have_transformer_engine())):
        d = work / family
        if dist.get_rank() == 0:
            small_model(d, family)
        dist.barrier()
        trainer = MegatronTrainer(RunConfig.from_args(args_for(2, sp)), d)
        hf = load_file(str(d / "model.safetensors"))
        if trainer.arch.tie_word_embeddings:
            hf.pop("lm_head.weight", None)
        out = dict(trainer.named_hf_tensors())
        exact = sorted(out) == sorted(hf) and all(
            torch.equal(out[k].view(torch.uint8), hf[k].view(torch.uint8)) for k in hf
        )
        ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(3))
        meg = token_log_probs(trainer.model(input_ids=ids).logits, ids)
        r = {"tp": 2, "sequence_parallel": sp, "round_trip_bit_exact": exact, "padded_vocab": trainer.padded_vocab}
        if dist.get_rank() == 0:
            with torch.no_grad():
                m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).cuda().eval()
                ref = token_log_probs(m(input_ids=ids.cuda()).logits.float().cpu(), ids)
                m.to(torch.bfloat16)
                hf16 = token_log_probs(m(input_ids=ids.cuda()).logits.float().cpu(), ids)
            r["logprob_maxdiff_megatron_vs_hf_fp32"] = (meg - ref).abs().max().item()
            r["logprob_maxdiff_hf_bf16_vs_hf_fp32"] = (hf16 - ref).abs().max().item()
        batch = TrainerBackendContract.make_batch(1000, 1.0)
        lp = TrainerBackendContract()._lp
        before = lp(trainer, batch)
        for _ in range(3):
            metrics = trainer.train_step(batch)
        r["trained_logprob_before_after"] = [before, lp(trainer, batch)]
        r["raised"] = r["trained_logprob_before_after"][1] > before
        r["grad_norm"] = metrics["train/grad_norm"]
        res[f"A_tp2_{family}"] = r
        log(f"A {family} TP=2 SP={sp}: {json.dumps(r)}")
    return trainer


def phase_b(trainer, work: Path, res: dict) -> None:
    from vime_core.weight_sync.nccl import broadcast_weights, receive_weights
    from vime_core.weight_sync.tensor_io import checksum, tensor_bytes

    tensors = dict(trainer.named_hf_tensors())  # collective: both ranks hold the full HF tensors
    if dist.get_rank() == 0:
        stats = broadcast_weights(tensors.items(), bucket_bytes=1 << 20, checksums=True)
        box = [None]
        dist.broadcast_object_list(box, src=1)
        res["B_small"] = {
            "bytes": stats.num_bytes,
            "tensors": stats.num_tensors,
            "buckets": stats.num_buckets,
            "seconds": stats.seconds,
            "receiver_bit_exact": box[0],
        }
        log(f"B small model over NCCL into receive_weights: {json.dumps(res['B_small'])}")
    else:
        got = {n: t.to("cpu") for n, t in receive_weights(src=0)}
        ok = sorted(got) == sorted(tensors) and all(
            checksum(tensor_bytes(got[n])) == checksum(tensor_bytes(t)) for n, t in tensors.items()
        )
        dist.broadcast_object_list([ok], src=1)
    # ~1B bf16 tensors, no digests: bandwidth
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("model.embed_tokens.weight", (32000, 2048)), ("lm_head.weight", (32000, 2048))]
    for i in range(16):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (2048, 2048)),
            (p + "self_attn.k_proj.weight", (2048, 2048)),
            (p + "self_attn.v_proj.weight", (2048, 2048)),
            (p + "self_attn.o_proj.weight", (2048, 2048)),
            (p + "mlp.gate_proj.weight", (5632, 2048)),
            (p + "mlp.up_proj.weight", (5632, 2048)),
            (p + "mlp.down_proj.weight", (2048, 5632)),
        ]
    big = {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for n, s in shapes}
    for bucket_mb in (512, 64):
        dist.barrier()
        if dist.get_rank() == 0:
            stats = broadcast_weights(big.items(), bucket_bytes=bucket_mb << 20)
            r = {
                "bucket_mib": bucket_mb,
                "bytes": stats.num_bytes,
                "buckets": stats.num_buckets,
                "seconds": stats.seconds,
                "GB_per_s": stats.num_bytes / stats.seconds / 1e9,
            }
            box = [None]
            dist.broadcast_object_list(box, src=1)
            r["receiver_equal_tensors"] = f"{box[0]}/{len(big)}"
            res[f"B_1b_bucket{bucket_mb}"] = r
            log(f"B ~1B bf16 weights over NCCL: {json.dumps(r)}")
        else:
            n = 0
            for name, t in receive_weights(src=0):
                n += int(torch.equal(t, big[name]))  # same generator and seed on both GPUs: same tensors
            dist.broadcast_object_list([n], src=1)
    del big


def phase_c(work: Path, res: dict, layout: str = "tp2", steps: int = 5, warmup: int = 2, batch: int = 16) -> None:
    """The ~1B model trained with ``layout`` (``tp1``: TP=1 on every rank, i.e. data parallelism over the world;
    ``tp2``: TP=2): median step time of ``batch`` × 1024-token samples per optimizer step (the same global batch in
    every layout, split over the DP ranks) and MFU per GPU."""
    from megatron.core import parallel_state as mpu
    from megatron_step import build_model, matmul_peak_tflops, rl_batch

    from vime_core.config import RunConfig
    from vime_core.trainer.megatron_backend import MegatronTrainer, have_transformer_engine

    tp = int(layout.removeprefix("tp"))
    world = dist.get_world_size()
    peak = matmul_peak_tflops()
    a = argparse.Namespace(vocab=32000, hidden=2048, ffn=5632, layers=16, heads=16, kv_heads=16, seq=1024)
    d = work / "llama-1b"
    if dist.get_rank() == 0 and not d.exists():
        build_model(d, a)
    dist.barrier()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    sp = tp > 1 and have_transformer_engine()  # the local spec's torch norms do not support sequence parallelism
    trainer = MegatronTrainer(RunConfig.from_args(args_for(tp, sp=sp, lr=1e-6)), d)
    n_params = sum(p.numel() for p in trainer.gpt.parameters()) * tp  # TP shards (norms counted tp times: ~0.001%)
    times = []
    for step in range(warmup + steps):
        rl = rl_batch(32000, batch, 1024, seed=step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(rl)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tflops = 6 * n_params * batch * 1024 / step_s / 1e12
    name = f"C_1b_{layout}_world{world}"
    res[name] = {
        "tp": tp,
        "dp": trainer.dp_size,
        "gpus": world,
        "sequence_parallel": sp,
        "params": n_params,
        "global_batch": batch,
        "step_s_median": step_s,
        "step_s_all": times,
        "peak_bf16_tflops": peak,
        "tflops_6nt_total": tflops,
        "mfu_per_gpu_6nt": tflops / world / peak,
    }
    log(f"C ~1B {layout} on {world} GPU(s) (DP={trainer.dp_size}): {json.dumps(res[name])}")
    del trainer
    gc.collect()
    torch.cuda.empty_cache()


def mfu_ratios(res: dict, baseline: dict) -> dict[str, float]:
    """MFU per GPU of every ``C_*`` result over the one-GPU TP=1 baseline's (``C_1b_tp1_world1`` of ``baseline``)."""
    base = baseline["C_1b_tp1_world1"]["mfu_per_gpu_6nt"]
    return {k: v["mfu_per_gpu_6nt"] / base for k, v in res.items() if k.startswith("C_1b_")}


def main() -> None:
    from vime_core.trainer.megatron_backend import init_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phases", default="A,B,C", help="phases to run, comma-separated (default A,B,C)")
    ap.add_argument(
        "--layouts",
        default="tp2",
        help="phase C's layouts, comma-separated: tp1 (TP=1: data parallelism over all ranks; on one process the "
        "one-GPU baseline) and/or tp2 (default tp2)",
    )
    ap.add_argument(
        "--baseline",
        default=None,
        help="JSON written by a one-process `--phases C --layouts tp1` run: print each layout's MFU per GPU over its "
        "(default: none)",
    )
    a = ap.parse_args()
    phases = set(a.phases.split(","))
    init_distributed()
    work = Path(tempfile.mkdtemp(prefix="vime-x2-")) if dist.get_rank() == 0 else None
    box = [str(work) if work else None]
    dist.broadcast_object_list(box, src=0)
    work = Path(box[0])
    res: dict = {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name()}
    trainer = None
    if "A" in phases:
        try:
            trainer = phase_a(work, res)
        except Exception as e:  # noqa: BLE001 - report and go on to the next phase
            res["A_error"] = repr(e)
            log(f"phase A failed: {e!r}")
            import traceback

            traceback.print_exc()
    todo = [("B", lambda: phase_b(trainer, work, res))] if "B" in phases and trainer is not None else []
    if "C" in phases:
        todo += [("C", lambda lay=lay: phase_c(work, res, lay)) for lay in a.layouts.split(",")]
    for name, fn in todo:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            res[name + "_error"] = repr(e)
            log(f"phase {name} failed: {e!r}")
            import traceback

            traceback.print_exc()
    if a.baseline:
        res["mfu_ratio_vs_tp1_one_gpu"] = mfu_ratios(res, json.loads(Path(a.baseline).read_text()))
        log(f"C MFU per GPU / one-GPU TP=1 MFU: {json.dumps(res['mfu_ratio_vs_tp1_one_gpu'])}")
    log("RESULT " + json.dumps(res))
    if dist.get_rank() == 0 and os.environ.get("OUT"):
        name = "megatron_x2.json" if dist.get_world_size() > 1 else "megatron_x1.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
