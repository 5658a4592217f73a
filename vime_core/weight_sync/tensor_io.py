"""Tensor I/O shared by the weight-sync strategies, the vLLM worker extension and the trainers: listing, reading and
inspecting safetensors files, a tensor's raw bytes and their digest, and grouping tensors into size-bounded buckets.

A leaf module (it imports nothing else of vime), so the trainer side, the engine side
(:mod:`vime_core.engines.worker_extension`) and every strategy can share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors import safe_open

DEFAULT_BUCKET_BYTES = 512 * 2**20  # slime's --update-weight-buffer-size


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


def safetensors_shapes(files: list[Path]) -> dict[str, list[int]]:
    """``{name: shape}`` of every tensor in ``files``, from the file headers (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                shapes[name] = list(st.get_slice(name).get_shape())
    return shapes


def iter_safetensors(files: list[Path], counter: list[int]) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` from each file, one tensor at a time (CPU tensors), counting them in ``counter[0]``."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                counter[0] += 1
                yield name, st.get_tensor(name)


def checksum(buf: np.ndarray | bytes) -> str:
    """xxh3-128 hex digest (32 characters) of a byte buffer."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(buf)) if isinstance(buf, np.ndarray) else buf)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t`` as a 1-D ``uint8`` numpy array (a copy: safe to keep while ``t`` changes)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().copy()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def tensor_from_bytes(buf: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`tensor_bytes`: a tensor of ``dtype``/``shape`` over a copy of ``buf``."""
    t = torch.from_numpy(np.array(buf, dtype=np.uint8, copy=True))
    return t.view(getattr(torch, dtype)).reshape(shape)


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists of at most ``bucket_bytes`` bytes (a larger tensor gets a bucket alone).

    :raises ValueError: if ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
