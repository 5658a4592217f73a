"""Worker for ``test_megatron_algorithms.py::test_tensor_parallel_matches_one_gpu`` (run under ``torchrun``): the
critic's values and the policy's log-probs of a batch, then one PPO + KL-loss + entropy step, with the megatron
backend at ``--tensor-model-parallel-size`` = world size; rank 0 writes the metrics to a JSON file.

Usage: ``torchrun --nproc-per-node N tests/gpu/megatron_tp_worker.py POLICY REF CRITIC OUT.json``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from tests.gpu.test_megatron_algorithms import _ppo_config, _samples
    from vime_core.algorithms.batch import build_batch
    from vime_core.builtins import advantages as est
    from vime_core.config.context import PluginContext
    from vime_core.trainer.megatron_backend import MegatronTrainer

    policy, ref, critic, out = sys.argv[1:5]
    world = int(os.environ["WORLD_SIZE"])
    config = _ppo_config({"critic": Path(critic), "ref": Path(ref)}, tensor_model_parallel_size=world)
    trainer = MegatronTrainer(config, Path(policy))
    batch = build_batch(PluginContext(config), [_samples()], est.ppo)
    values = trainer.critic.values(batch.samples, 4)
    with torch.no_grad():
        lps = [lp.float().cpu().tolist() for lp in trainer.policy_log_probs(batch.samples, False)[0]]
    metrics = trainer.train_step(batch)
    if trainer.rank == 0:
        Path(out).write_text(
            json.dumps({"metrics": metrics, "values": [values[id(s)].tolist() for s in batch.samples], "lps": lps})
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
