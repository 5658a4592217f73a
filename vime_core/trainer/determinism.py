"""``--deterministic-mode`` in the trainer: the same numbers for the same batch every time, and where vLLM is installed
its batch-invariant kernels, so that the trainer's matmuls and softmaxes are computed as a batch-invariant engine
(``--vllm-enable-deterministic-inference``, ``VLLM_BATCH_INVARIANT=1``) computes them. The true-on-policy mode and
what it costs: docs/gpu.md, "|Δlogp|".
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("vime.trainer")

#: cuBLAS's deterministic workspace setting (read when the process creates its first cuBLAS handle)
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def enable_trainer_determinism() -> dict[str, bool]:
    """Call before the trainer's first CUDA matmul: ``CUBLAS_WORKSPACE_CONFIG`` (unless set),
    ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a deterministic kernel warns instead
    of failing the run), cuDNN deterministic, TF32 off, and — where ``vllm`` imports with CUDA — vLLM's
    ``enable_batch_invariant_mode()`` (its matmul settings and Triton softmax/log-softmax/mean kernels, the ones a
    ``VLLM_BATCH_INVARIANT=1`` engine runs).

    :return: ``{"deterministic_algorithms": True, "vllm_batch_invariant": <whether vLLM's mode is on>}``.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    invariant = False
    if torch.cuda.is_available():
        try:
            from vllm.model_executor.layers.batch_invariant import enable_batch_invariant_mode
        except Exception as e:  # noqa: BLE001 - vLLM absent or another release: deterministic kernels only
            logger.warning("--deterministic-mode: vLLM's batch-invariant kernels are not importable here (%s)", e)
        else:
            enable_batch_invariant_mode()
            invariant = True
    logger.info("--deterministic-mode: deterministic algorithms on, vLLM batch-invariant kernels %s", invariant)
    return {"deterministic_algorithms": True, "vllm_batch_invariant": invariant}
