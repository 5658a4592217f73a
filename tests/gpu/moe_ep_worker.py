"""Worker for tests/gpu/test_moe_ep_gpu.py (run under ``torchrun``): the megatron trainer on a small Qwen3-MoE at
``--expert-model-parallel-size`` = world size (EP = 1 on one GPU, EP = 2 on two: then DP = 2 for the dense part),
with ``--use-rollout-routing-replay`` and transformers' fp32 routes as the recorded ones. Every rank checks that its
routers select exactly the recorded experts for every token, and that the weights it gathers (experts of every EP
rank under their global names) equal the checkpoint bit for bit; then one GRPO step (its metrics: rank 0) and three
more, timed (seconds per step on the same global batch). Each rank writes ``OUT.rank{r}.json``.

Usage: ``torchrun --nproc-per-node N tests/gpu/moe_ep_worker.py MODEL_DIR OUT``
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from tests.gpu.test_megatron_moe_gpu import router_choices
    from vime_core.testing.tiny_moe import random_samples, transformers_routes
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.types import RolloutBatch

    model, out = Path(sys.argv[1]), sys.argv[2]
    world = int(os.environ["WORLD_SIZE"])
    config = trainer_config(
        expert_model_parallel_size=world,
        use_rollout_routing_replay=True,
        global_batch_size=8,
        micro_batch_size=2,
        lr=1e-4,
    )
    trainer = MegatronTrainer(config, model)
    original = load_file(str(model / "model.safetensors"))  # saved in bf16
    original.pop("lm_head.weight", None)
    got = dict(trainer.named_hf_tensors())  # collective: every EP rank's experts
    weights_equal = sorted(got) == sorted(original) and all(
        torch.equal(got[k].cpu().view(torch.uint8), original[k].to(got[k].dtype).contiguous().view(torch.uint8))
        for k in original
    )
    samples = random_samples(trainer.arch.vocab_size, n=8)
    routes, _ = transformers_routes(model, samples)
    for s, r in zip(samples, routes, strict=True):
        s.routed_experts = r
    chosen, handles = router_choices(trainer)
    with torch.no_grad():
        trainer.policy_log_probs(samples, False)
    seq = max(len(s.tokens) for s in samples)
    replay_equal = all(
        ids.view(seq, len(samples), -1)[: len(s.tokens) - 1, i].tolist()
        == np.sort(s.routed_experts[:, layer], axis=-1).tolist()
        for layer, ids in chosen.items()
        for i, s in enumerate(samples)
    )
    for h in handles:
        h.remove()
    advantages = [[1.0 if s.reward else -1.0] * s.response_length for s in samples]
    metrics = trainer.train_step(RolloutBatch(samples, advantages))
    # speed: three more steps on the same global batch (the first one above warmed up), seconds per step
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.train_step(RolloutBatch(samples, advantages))
    torch.cuda.synchronize()
    step_seconds = (time.perf_counter() - t0) / 3
    result = {
        "rank": trainer.rank,
        "ep_rank": trainer.ep_rank,
        "local_experts": sum(
            1 for n, _ in trainer.gpt.named_parameters() if "local_experts" in n and "layers.0." in n
        ),
        "weights_equal": weights_equal,
        "replay_equal": replay_equal,
        "moe_layers": sorted(chosen),
        "step_seconds": step_seconds,
    }
    if trainer.rank == 0:
        result["metrics"] = metrics
    Path(f"{out}.rank{trainer.rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
