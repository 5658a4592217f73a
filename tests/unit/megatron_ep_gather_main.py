"""Run by tests/unit/test_megatron_moe.py: two CPU processes (gloo) each hold one EP rank's part of two MoE
layers' Megatron tensors (:func:`~vime_core.trainer.megatron_moe.ep_shard`) and gather every rank's experts with
:func:`~vime_core.trainer.megatron_experts.gather_experts` (what the megatron trainer's ``named_hf_tensors`` does
under ``--expert-model-parallel-size 2``); each writes whether its gathered dict equals the full one bit for bit.

Usage: ``python tests/unit/megatron_ep_gather_main.py PORT OUT_PREFIX``
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def full_tensors() -> dict[str, torch.Tensor]:
    """Megatron tensors of two MoE layers with 8 SequentialMLP experts each, plus a router and a norm (random, the
    same on every rank)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in (0, 1):
        m = f"decoder.layers.{layer}."
        out[m + "pre_mlp_layernorm.weight"] = torch.randn(16, generator=g)
        out[m + "mlp.router.weight"] = torch.randn(8, 16, generator=g)
        for e in range(8):
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(8, 16, generator=g)
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.randn(16, 4, generator=g)
    return out


def rank_main(rank: int, port: int, out: str) -> None:
    from vime_core.trainer.megatron_experts import gather_experts
    from vime_core.trainer.megatron_moe import ep_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    full = full_tensors()
    local = ep_shard(full, rank, 2, 8)
    got = gather_experts(local, 2, dist.group.WORLD)
    equal = sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)
    experts = len([n for n in local if ".local_experts." in n and "layers.0." in n])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"gathered_equals_full": equal, "local_expert_tensors_layer0": experts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
