"""CUDA IPC transport for colocated trainer and engine (same GPU): weights shared by handle, no copy on the wire.

The transport of the ``ipc`` weight-sync design: the trainer packs HF-layout GPU tensors into flat ``uint8`` buckets
(so one IPC handle covers many tensors, like slime's ``FlattenedTensorBucket``) and passes picklable handles plus
metadata; the engine side (:func:`open_shared_weights`) maps each bucket and yields ``(name, tensor)`` views for
``reload_weights``. The trainer must keep the returned buffers alive until every receiver is done.

The registered strategy is :class:`IpcWeightSync` (``--weight-sync ipc``). Tested between two processes on one H200
(``bench/ipc_weight_sync.py``, ``tests/gpu/test_weight_sync_gpu.py``); its engine side
(``VimeWorkerExtension.vime_receive_ipc``) needs a vLLM on a GPU, which none of our machines has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vime_core.config import RunConfig
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate, call_with_timeout
from vime_core.weight_sync.host_copy import HostCopy
from vime_core.weight_sync.lora_transfer import AdapterCopy, drop_staged, stage_and_load
from vime_core.weight_sync.tensor_io import DEFAULT_BUCKET_BYTES, buckets


def share_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Trainer side: copy tensors (CUDA) into flat buckets and make IPC handles for them.

    :param named_tensors: ``(hf_name, CUDA tensor)``.
    :param bucket_bytes: bucket size in bytes (a larger tensor gets a bucket alone).
    :return: ``(buffers, payload)``: keep ``buffers`` alive while receivers use them; ``payload`` is picklable,
        one dict per bucket ``{"handle", "names", "dtypes", "shapes", "nbytes"}``.
    :raises ValueError: for a tensor that is not on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    buffers, payload = [], []
    for bucket in buckets(named_tensors, bucket_bytes):
        for name, t in bucket:
            if not t.is_cuda:
                raise ValueError(f"{name}: CUDA IPC needs CUDA tensors, got {t.device}")
        buf = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
        buffers.append(buf)
        payload.append(
            {
                "handle": reduce_tensor(buf),
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "nbytes": [t.numel() * t.element_size() for _, t in bucket],
            }
        )
    return buffers, payload


def bucket_views(buffers: list[torch.Tensor], payload: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Trainer side: ``(hf_name, view)`` of every tensor in its own buckets (what :func:`open_shared_weights`
    yields in the engine)."""
    for buf, bucket in zip(buffers, payload, strict=True):
        yield from _views(buf, bucket)


def _views(buf: torch.Tensor, bucket: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, dtype, shape, n in zip(
        bucket["names"], bucket["dtypes"], bucket["shapes"], bucket["nbytes"], strict=True
    ):
        yield name, buf[offset : offset + n].view(getattr(torch, dtype)).reshape(shape)
        offset += n


def open_shared_weights(payload: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: map each bucket by its handle and yield ``(hf_name, tensor)`` views into it (no copy)."""
    for bucket in payload:
        rebuild, args = bucket["handle"]
        yield from _views(rebuild(*args), bucket)


# -- the registered strategy ------------------------------------------------------------------------------------------
def encode_payload(payload: list[dict[str, Any]]) -> str:
    """Pickle + base64 the handles so they travel in ``/collective_rpc``'s JSON body."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps(payload)).decode("ascii")


def decode_payload(blob: str) -> list[dict[str, Any]]:
    """Inverse of :func:`encode_payload` (trusted input: it comes from this run's own trainer on this host)."""
    import base64
    import pickle

    return pickle.loads(base64.b64decode(blob))  # noqa: S301 - the trainer of this run produced it


def _read_in_child(blob: str, conn: Any) -> None:
    """Child process of :meth:`IpcWeightSync.read`: map the handles and send CPU copies back."""
    import io

    try:
        buf = io.BytesIO()  # bytes, not tensors: torch would pass CPU tensors by a handle that dies with this process
        torch.save({n: t.to("cpu", copy=True) for n, t in open_shared_weights(decode_payload(blob))}, buf)
        conn.send(buf.getvalue())
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(e)


class IpcWeightSync(WeightSyncStrategy):
    """``ipc`` weight sync for a trainer and engines colocated on the same GPUs: no bytes move.

    :meth:`push` copies the trainer's HF-layout CUDA tensors into flat buckets of ``--update-weight-buffer-size``
    bytes and makes one CUDA IPC handle per bucket (like slime's ``FlattenedTensorBucket``); :meth:`apply` sends the
    pickled handles to the engine's workers (``/collective_rpc vime_receive_ipc``), which map them and feed the
    views to ``reload_weights``. The buckets stay alive until :meth:`cleanup` (after every engine applied them).
    Engines must run on the trainer's GPU(s).

    Memory: one extra copy of the weights on the GPU during a sync (the buckets).

    With ``--update-weight-disk-dir`` set (``vime run`` sets it), each version is also copied to disk in the
    background (:class:`vime_core.weight_sync.host_copy.HostCopy`; payload ``recovery_dir``), so a replacement
    engine can be brought to the current version at any step.
    """

    NAME = "ipc"
    CARRIES_LORA = True
    RELOADS_ALL_WEIGHTS = True  # every tensor of the model, each version
    TENSOR_DEVICE = None  # the trainer's GPU tensors go straight into the buckets

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.bucket_bytes = int(self.config.update_weight_buffer_size or DEFAULT_BUCKET_BYTES)
        self._buffers: dict[int, list[torch.Tensor]] = {}
        root = self.config.update_weight_disk_dir
        self.host_copy = HostCopy(root) if root is not None else None
        self.adapter_copy = AdapterCopy(root) if root is not None else None

    def _share(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[list, list, int]:
        """Buckets and handles of ``version``; the buckets of earlier versions are released first (the trainer
        pushes a version only after the engines applied the one before, and the trainer-side instance never sees
        the rollout side's :meth:`cleanup`)."""
        for old in [v for v in self._buffers if v != version]:
            del self._buffers[old]
        dev = torch.device("cuda", torch.cuda.current_device())
        on_gpu = ((n, t if t.is_cuda else t.to(dev)) for n, t in named_tensors)  # the bucket is a copy anyway
        buffers, payload = share_weights(on_gpu, self.bucket_bytes)
        torch.cuda.synchronize()
        self._buffers[version] = buffers
        return buffers, payload, sum(int(b.numel()) for b in buffers)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightUpdate:
        """Share ``named_tensors`` by handle as ``version`` (CPU tensors are copied to the current GPU first).

        :raises RuntimeError: without a CUDA device.
        """
        import time

        t0 = time.perf_counter()
        buffers, payload, nbytes = self._share(named_tensors, version)
        body: dict[str, Any] = {"handles": encode_payload(payload)}
        if self.host_copy is not None:  # for replacement engines, written in the background
            body["recovery_dir"] = str(self.host_copy.start(version, bucket_views(buffers, payload)))
        return WeightUpdate(version, body, num_bytes=nbytes, seconds=time.perf_counter() - t0)

    def push_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int) -> WeightUpdate:
        """Share a LoRA adapter's tensors by handle as ``version``; its PEFT files are written to
        ``--update-weight-disk-dir`` in the background (for replacement engines), the engines never read them.

        :raises ValueError: without ``--update-weight-disk-dir``.
        """
        import time

        if self.adapter_copy is None:
            raise ValueError(
                "--weight-sync ipc with LoRA needs --update-weight-disk-dir (replacement engines load "
                "the kept adapters from there)"
            )
        t0 = time.perf_counter()
        buffers, payload, nbytes = self._share(tensors.items(), version)
        path = self.adapter_copy.start(version, bucket_views(buffers, payload), config)
        body = {"handles": encode_payload(payload), "lora": True, "config": dict(config), "path": str(path)}
        return WeightUpdate(version, body, num_bytes=nbytes, seconds=time.perf_counter() - t0)

    def apply(self, engine: Any, update: WeightUpdate, timeout_s: float) -> None:
        """Make ``engine``'s workers map the handles and reload from them within ``timeout_s`` seconds (an
        adapter: stage it in the workers' host memory and load it as ``update.payload["adapter"]``).

        :raises TimeoutError: if the engine does not answer in time.
        """
        if update.payload.get("lora"):
            call_with_timeout(
                lambda: stage_and_load(engine, update, {"handles": update.payload["handles"]}),
                timeout_s,
                f"ipc: engine {getattr(engine, 'url', engine)} loading adapter {update.payload['adapter']} "
                f"(version {update.version})",
            )
            return
        call_with_timeout(
            lambda: engine.collective_rpc(
                "vime_receive_ipc", kwargs={"handles": update.payload["handles"], "version": update.version}
            ),
            timeout_s,
            f"ipc: engine {getattr(engine, 'url', engine)} loading version {update.version}",
        )

    def read(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Map the handles in a fresh process (CUDA IPC handles open only in another process) and return CPU
        copies of what it saw.

        :raises KeyError: if the update was cleaned up.
        """
        import torch.multiprocessing as mp

        if update.version not in self._buffers:
            raise KeyError(f"ipc: version {update.version} was cleaned up")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_in_child, args=(update.payload["handles"], child))
        proc.start()
        try:
            got = parent.recv()
        finally:
            proc.join(timeout=60)
        if isinstance(got, BaseException):
            raise got
        import io

        return torch.load(io.BytesIO(got), weights_only=True)

    def unload_adapter(self, engine: Any, update: WeightUpdate) -> None:
        """Drop the adapter's tensors staged in ``engine``'s workers (it no longer serves it)."""
        drop_staged(engine, update)

    def cleanup(self, update: WeightUpdate) -> None:
        """Release the version's buckets (after every engine applied it); an adapter's files too (once it is
        retired) unless ``--keep-weight-updates``."""
        self._buffers.pop(update.version, None)
        if update.payload.get("lora"):
            AdapterCopy.remove(update, bool(self.config.keep_weight_updates))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
