"""The trainer group: one :class:`TrainerWorker` Ray actor per trainer rank (:class:`TrainerGroup`), each hosting a
trainer backend and the trainer side of the weight-sync strategy, with torchrun's environment.

The driver resolves ``--trainer`` and ``--weight-sync`` and hands the classes down (:class:`TrainerClasses`; Ray
pickles them by reference), so no trainer rank loads the plugins. Where the ranks go: docs/cluster.md.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.cluster.orchestration import RendezvousProbe, actor_placement, slot_options
from vime_core.cluster.placement import PlacementPlan, parse_cpu_list
from vime_core.config import RunConfig
from vime_core.trainer.base import TrainerBackend
from vime_core.trainer.gc_control import GcClock, ManualGc, freeze_heap
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate, WeightWriteError


@dataclass(frozen=True)
class TrainerClasses:
    """What every trainer rank builds: the ``--trainer`` backend class and the ``--weight-sync`` strategy class.

    :ivar backend: a :class:`~vime_core.trainer.base.TrainerBackend` subclass.
    :ivar weight_sync: a :class:`~vime_core.weight_sync.base.WeightSyncStrategy` subclass.
    """

    backend: type[TrainerBackend]
    weight_sync: type[WeightSyncStrategy]


class TrainerWorker:
    """One trainer rank: hosts a trainer backend and the trainer side of the weight-sync strategy (a Ray actor).

    :param config: the run's configuration (the backend and the strategy get it whole).
    :param model_path: HF directory of the policy.
    :param classes: the ``--trainer`` backend and ``--weight-sync`` strategy classes, resolved by the driver.
    :param rank: this rank (0 … ``world_size - 1``).
    :param world_size: ranks in the group; above 1 the torchrun variables in ``dist_env`` are set first.
    :param dist_env: ``MASTER_ADDR``/``MASTER_PORT`` of the group's rendezvous (empty for one rank).
    """

    def __init__(
        self,
        config: RunConfig,
        model_path: Path,
        classes: TrainerClasses,
        rank: int = 0,
        world_size: int = 1,
        dist_env: dict[str, str] | None = None,
    ) -> None:
        cluster = config.cluster
        if cluster.train_cpus:  # before the backend starts torch's thread pool (threads inherit it)
            os.sched_setaffinity(0, parse_cpu_list(cluster.train_cpus))
        self.rank, self.world_size = rank, world_size
        self.colocate = cluster.colocate and cluster.offload_rollout  # an engine wakes into the freed memory
        backend_cls = classes.backend
        if world_size > 1:
            if not getattr(backend_cls, "DISTRIBUTED", False):
                raise ValueError(
                    f"--trainer {cluster.trainer} runs as one rank, but --actor-num-nodes × --actor-num-gpus-per-node "
                    f"asks for {world_size}: use a distributed backend (--trainer megatron) or one trainer GPU"
                )
            os.environ.update(group_env(rank, world_size, dist_env or {}))
            init_process_group_from_env()
        else:  # one rank: a rendezvous inherited from the driver's environment (torchrun, a test) is not this group's
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)
        self.backend = backend_cls(config, Path(model_path))
        self.weight_sync = classes.weight_sync(config)
        self.lora = config.lora.enabled  # push the adapter, not the weights
        # the start-up heap (modules, model, optimizer: ~0.5 M objects) out of every later collection
        self.frozen_objects = freeze_heap()
        self.manual_gc = ManualGc(config.trainer.manual_gc_interval) if config.trainer.manual_gc else None
        self.gc_clock = GcClock()

    def placement(self) -> dict[str, Any]:
        """Where this rank runs (:func:`actor_placement`), with ``rank``/``world_size`` and the torchrun variables."""
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return {
            **actor_placement(),
            "rank": self.rank,
            "world_size": self.world_size,
            "env": {k: os.environ[k] for k in keys if k in os.environ},
        }

    def gpu_free_bytes(self) -> int | None:
        """Free memory of this rank's GPU in bytes (``torch.cuda.mem_get_info``: the whole device, every process on
        it counted), or ``None`` without CUDA."""
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None

    def train_step(self, batch: Any) -> dict[str, float]:
        """The backend's step; with ``--colocate`` on a GPU (and not ``--no-offload-rollout``), then the allocator's
        cached blocks go back to the device (the engine that wakes up next on the same GPU needs them).

        Adds to the backend's metrics ``perf/train_worker_time`` (this call, seconds), ``perf/empty_cache_time``, the
        garbage collections inside the call (``perf/train_gc_time`` in seconds, ``perf/train_gc_collections``,
        ``perf/train_gc_full_collections``; with ``--manual-gc`` they include its collection after the step), with
        CUDA ``perf/train_cuda_mallocs`` (segments the caching allocator took from the driver in the step) and,
        when the weight sync writes host copies (``ipc``), ``perf/host_copy_overlap_time`` (seconds of this step
        during which the previous version's host copy was still being written in this process) and
        ``weight_sync/host_copy_seconds`` (how long the last finished copy took).
        """
        import time

        import torch

        from vime_core.trainer.profile import cuda_malloc_count

        t0 = time.perf_counter()
        self.gc_clock.start()
        mallocs = cuda_malloc_count()
        metrics = self.backend.train_step(batch)
        if mallocs is not None:
            metrics["perf/train_cuda_mallocs"] = float(cuda_malloc_count() - mallocs)
        if self.manual_gc is not None:
            self.manual_gc.after_step()
        metrics.update(self.gc_clock.stop())
        t1 = time.perf_counter()
        if self.colocate and torch.cuda.is_available():
            torch.cuda.empty_cache()
            metrics["perf/empty_cache_time"] = time.perf_counter() - t1
        end = time.perf_counter()
        metrics["perf/train_worker_time"] = end - t0
        copy = getattr(self.weight_sync, "host_copy", None)
        if copy is not None:
            metrics["perf/host_copy_overlap_time"] = copy.overlap(t0, end)
            metrics["weight_sync/host_copy_seconds"] = copy.last_seconds
        return metrics

    def push_weights(self, version: int) -> WeightUpdate | None:
        """Rank 0 publishes the weights through the strategy; the other ranks only take part in the gather
        (``named_hf_tensors`` is a collective under TP) and return ``None``. With LoRA the adapter alone
        (``lora_adapter``, then the strategy's ``push_adapter``)."""
        if self.lora:
            tensors, config = self.backend.lora_adapter()  # a collective under TP too
            return self.weight_sync.push_adapter(tensors, config, version) if self.rank == 0 else None
        device = getattr(self.weight_sync, "TENSOR_DEVICE", "cpu")
        takes_device = "device" in inspect.signature(self.backend.named_hf_tensors).parameters
        tensors = self.backend.named_hf_tensors(device=device) if takes_device else self.backend.named_hf_tensors()
        if self.rank != 0:
            for _ in tensors:
                pass
            return None
        return self.weight_sync.push(tensors, version)

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(Path(path))

    def save_adapter(self, path: str) -> None:
        """LoRA: the backend's PEFT adapter directory (``final_adapter/``)."""
        self.backend.save_adapter(Path(path))

    def write_nonce(self, directory: str, nonce: str) -> str:
        """Write ``nonce`` to ``directory/.vime-nonce-<nonce>`` (the shared-filesystem check of ``disk`` weight
        sync) and return the file's path.

        :raises WeightWriteError: naming ``--update-weight-disk-dir`` when the directory cannot be written
            (read-only, full, no permission).
        """
        path = Path(directory) / f".vime-nonce-{nonce}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(nonce)
        except OSError as e:
            raise WeightWriteError(
                f"--update-weight-disk-dir {directory}: cannot write there ({e.strerror or e}); disk weight sync "
                "writes every weight version there"
            ) from None
        return str(path)

    def remove_file(self, path: str) -> None:
        """Remove ``path`` on this rank's node (the nonce file after the check)."""
        Path(path).unlink(missing_ok=True)


def group_env(rank: int, world_size: int, rendezvous: dict[str, str]) -> dict[str, str]:
    """torchrun's environment for ``rank`` of a group (``LOCAL_RANK`` is 0: Ray gives each rank its own GPU
    through ``CUDA_VISIBLE_DEVICES``, so every rank's device is ``cuda:0``).

    :param rendezvous: ``{"MASTER_ADDR": ..., "MASTER_PORT": ...}`` from rank 0.
    """
    return {
        **rendezvous,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }


def init_process_group_from_env(timeout_s: float = 1800.0) -> None:
    """``torch.distributed.init_process_group`` from torchrun's environment (see :func:`group_env`), unless already
    initialised: NCCL on ``cuda:LOCAL_RANK`` when CUDA is available, else Gloo (CPU)."""
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)


class TrainerGroup:
    """One :class:`TrainerWorker` Ray actor per trainer rank of ``plan``, with the calls the loop makes.

    Every rank gets every call (collectives inside the backend need all ranks; ``train_step`` the whole batch, of
    which each data-parallel rank trains on its shard); metrics, weight updates and
    checkpoints are rank 0's (the backend gathers onto and writes from rank 0, as Megatron's backend does).

    :param config: the run's configuration (each rank's :class:`TrainerWorker` gets it).
    :param model_path: HF directory of the policy.
    :param classes: the backend and weight-sync classes every rank builds (resolved by the driver).
    :param plan: the placement plan (its ``trainer`` slots).
    :param pg: the plan's placement group (``None`` in a plan without bundles).
    """

    def __init__(
        self, config: RunConfig, model_path: Path, classes: TrainerClasses, plan: PlacementPlan, pg: Any
    ) -> None:
        import ray

        slots = plan.trainer
        self.world_size = len(slots)
        rendezvous: dict[str, str] = {}
        if self.world_size > 1:
            probe = ray.remote(RendezvousProbe).options(**slot_options(slots[0], pg, gpu_share=0.01)).remote()
            rendezvous = ray.get(probe.rendezvous.remote())
            ray.kill(probe)
        self.rendezvous = rendezvous
        self.workers = [
            ray.remote(TrainerWorker)
            .options(**slot_options(slot, pg), max_concurrency=1)
            .remote(config, str(model_path), classes, rank, self.world_size, rendezvous)
            for rank, slot in enumerate(slots)
        ]

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def ready_calls(self) -> dict[str, Any]:
        """``{"trainer rank N": ObjectRef}``: each rank's :meth:`TrainerWorker.placement`, answered once its backend
        has loaded (for :func:`wait_setup`)."""
        return {f"trainer rank {i}": w.placement.remote() for i, w in enumerate(self.workers)}

    def gpu_free_bytes(self) -> int | None:
        """Rank 0's :meth:`TrainerWorker.gpu_free_bytes`."""
        import ray

        return ray.get(self.workers[0].gpu_free_bytes.remote())

    def train_step(self, batch: Any) -> dict[str, float]:
        """Every rank gets the whole ``batch`` (put into Ray's object store once) and trains on its data-parallel
        shard of it (:func:`vime_core.trainer.rl_step.dp_shard`); rank 0's metrics (summed over the DP ranks)."""
        import ray

        return self._all("train_step", ray.put(batch) if self.world_size > 1 else batch)[0]

    def push_weights(self, version: int) -> WeightUpdate:
        """Every rank gathers (a collective under TP); rank 0's update goes to the engines."""
        return self._all("push_weights", version)[0]

    def shutdown(self) -> None:
        """Kill every rank's actor (their GPUs return to the placement group)."""
        import ray

        for w in self.workers:
            ray.kill(w)

    def placements(self) -> list[dict[str, Any]]:
        """Each rank's :meth:`TrainerWorker.placement`, in rank order."""
        return self._all("placement")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def save_adapter(self, path: str) -> None:
        self._all("save_adapter", path)

    def check_shared_dir(self, directory: str, rollout: Any) -> None:
        """``disk``/``disk-delta`` weight sync needs ``directory`` on a filesystem that trainer rank 0 and every
        engine share: rank 0 writes a random nonce file there and each engine actor must read it back.

        :param rollout: the rollout manager actor (its ``check_weight_dir`` asks each engine).
        :raises RuntimeError: naming ``--update-weight-disk-dir`` and each engine that cannot see the file.
        """
        import uuid

        import ray

        nonce = uuid.uuid4().hex
        path = ray.get(self.workers[0].write_nonce.remote(directory, nonce))
        try:
            problems = ray.get(rollout.check_weight_dir.remote(path, nonce))
        finally:
            ray.get(self.workers[0].remove_file.remote(path))
        if problems:
            raise RuntimeError(
                f"--update-weight-disk-dir {directory} is not shared between trainer rank 0 and the engines "
                "(disk weight sync would load stale or missing files); put it on a filesystem every node mounts "
                "at the same path, or use --weight-sync nccl:\n  " + "\n  ".join(problems)
            )
