"""Run by tests/unit/test_megatron_moe.py: two CPU processes (gloo) each hold one EP rank's part of the tiny
Qwen3-MoE's Megatron tensors (:func:`~vime_core.trainer.megatron_moe.ep_shard`) and gather every rank's experts with
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


def rank_main(rank: int, port: int, out: str) -> None:
    from vime_core.testing.tiny_moe import tiny_moe_config
    from vime_core.trainer.megatron_convert import ArchConfig, hf_to_megatron
    from vime_core.trainer.megatron_experts import gather_experts
    from vime_core.trainer.megatron_moe import ep_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import transformers

    config = tiny_moe_config("qwen3_moe", 256, {"<|endoftext|>": 0, "<|im_end|>": 2})
    torch.manual_seed(0)  # the same model on both ranks
    model = transformers.AutoModelForCausalLM.from_config(config)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    full = hf_to_megatron(sd, ArchConfig.from_hf(config))
    local = ep_shard(full, rank, 2, 8)
    got = gather_experts(local, 2, dist.group.WORLD)
    equal = sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)
    experts = len([n for n in local if ".local_experts." in n and "layers.0." in n])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"gathered_equals_full": equal, "local_expert_tensors_layer0": experts}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
