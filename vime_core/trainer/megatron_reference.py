"""Entropy and the reference model of the ``megatron`` backend: :func:`vocab_parallel_entropy` (entropy of a softmax
over a tensor-parallel vocabulary) and :class:`MegatronReferenceModel` (the frozen policy KL is measured against).
megatron-core is imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vime_core.models import resolve_model
from vime_core.trainer.megatron_experts import float16_module
from vime_core.trainer.megatron_view import MegatronPolicy
from vime_core.types import Sample


def vocab_parallel_entropy(logits: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """Entropy ``H = log Z - sum_v p_v z_v`` (nats) of softmax over a vocabulary split across tensor-parallel ranks.

    :param logits: ``[..., vocab / tp]`` float32 logits of this rank's vocabulary shard (``-inf`` columns allowed:
        padding).
    :param tp_group: the tensor-parallel group; None without TP.
    :return: ``[...]`` float32 entropies, differentiable (Megatron's reduce-from-TP-region: all-reduce forward,
        identity backward, so every rank's gradient is its shard's).
    """
    import torch.distributed as dist

    m = logits.detach().amax(dim=-1, keepdim=True)
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    # padding columns (-inf) become -1e4 below the max: exp underflows to exactly 0 and 0 * -1e4 = 0 (no NaN), and
    # their gradient is 0; a real logit that far below the max has probability exp(-1e4) = 0 in float32 anyway
    z = (logits - m).clamp_min(-1e4)
    e = torch.exp(z)
    sum_e, sum_ez = e.sum(-1), torch.linalg.vecdot(e, z)  # vecdot: no [..., vocab] temporary
    if tp_group is not None:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sum_e = reduce_from_tensor_model_parallel_region(sum_e, tp_group)
        sum_ez = reduce_from_tensor_model_parallel_region(sum_ez, tp_group)
    return torch.log(sum_e) - sum_ez / sum_e


class MegatronReferenceModel:
    """The frozen reference policy for KL on the megatron backend: a second ``GPTModel`` (bf16, same parallel
    layout, no gradients) loaded from ``--ref-load`` (an HF directory or known model name; default: the initial
    policy).

    :param trainer: the policy trainer (architecture, layout, HF loading).
    """

    def __init__(self, trainer: MegatronPolicy) -> None:

        self.trainer = trainer
        ref = trainer.algorithm_config.ref_load
        path = Path(ref or trainer.model_path)
        if ref and not (path / "config.json").is_file():
            path = resolve_model(str(ref))
        self.path = path
        gpt = trainer.new_gpt()
        trainer.load_hf_tensors(trainer.read_hf(path), gpt=gpt)
        gpt.requires_grad_(False)
        self.module = float16_module(trainer.config, gpt)
        self.module.eval()

    @torch.no_grad()
    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Reference log-probs of every sample's response, keyed by ``id(sample)`` (float32, CPU, no grad)."""
        t = self.trainer
        out: dict[int, torch.Tensor] = {}
        for i in range(0, len(samples), micro_batch_size):
            mb = samples[i : i + micro_batch_size]
            ids, pos = t.token_batch(mb)
            lp, _ = t.token_log_probs(ids, pos, module=self.module)
            for s, x in zip(mb, t.response_slices(mb, lp), strict=True):
                out[id(s)] = x.float().cpu()
        return out
