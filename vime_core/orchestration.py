"""Ray orchestration: the cluster ``vime run`` runs on, the placement group of its plan, and the trainer group.

:func:`init_ray` starts a loopback-only single-node Ray or joins ``--ray-address``; :func:`create_placement_group`
and :func:`slot_options` reserve and use the bundles of a :class:`~vime_core.placement.PlacementPlan` (Ray picks the
GPUs); :class:`TrainerGroup` runs one :class:`TrainerWorker` per rank with torchrun's environment. What runs where:
docs/cluster.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime_core.config import ClusterConfig, RunConfig
from vime_core.net import find_free_port, node_ip
from vime_core.placement import (
    NodeResources,
    PlacementError,
    PlacementPlan,
    ResourceFlags,
    Slot,
    parse_cpu_list,
    plan_placement,
)
from vime_core.plugins import get_plugins  # importing vime_core set Ray's loopback environment (see __init__)
from vime_core.weight_sync.base import WeightUpdate, WeightWriteError

logger = logging.getLogger("vime.orchestration")

#: seconds to wait for Ray to place a plan's bundles (the plan already fits the cluster's totals)
PLACEMENT_TIMEOUT_S = 120.0


class TrainerWorker:
    """One trainer rank: hosts a trainer backend and the trainer side of the weight-sync strategy (a Ray actor).

    :param config: the run's configuration (the backend and the strategy get it whole).
    :param model_path: HF directory of the policy.
    :param rank: this rank (0 … ``world_size - 1``).
    :param world_size: ranks in the group; above 1 the torchrun variables in ``dist_env`` are set first.
    :param dist_env: ``MASTER_ADDR``/``MASTER_PORT`` of the group's rendezvous (empty for one rank).
    """

    def __init__(
        self,
        config: RunConfig,
        model_path: Path,
        rank: int = 0,
        world_size: int = 1,
        dist_env: dict[str, str] | None = None,
    ) -> None:
        cluster = config.cluster
        if cluster.train_cpus:  # before the backend starts torch's thread pool (threads inherit it)
            os.sched_setaffinity(0, parse_cpu_list(cluster.train_cpus))
        self.rank, self.world_size = rank, world_size
        self.colocate = cluster.colocate
        plugins = get_plugins()
        backend_cls = plugins.resolve("trainer", cluster.trainer)
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
        self.weight_sync = plugins.resolve("weight_sync", cluster.weight_sync)(config)
        self.lora = config.lora.enabled  # push the adapter, not the weights

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
        """The backend's step; with ``--colocate`` on a GPU, then the allocator's cached blocks go back to the device
        (the engine that wakes up next on the same GPU needs them)."""
        metrics = self.backend.train_step(batch)
        if self.colocate:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
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


class RendezvousProbe:
    """Runs on rank 0's bundle before the group starts: its node address and a port free there."""

    def rendezvous(self) -> dict[str, str]:
        return {"MASTER_ADDR": node_ip(), "MASTER_PORT": str(find_free_port(node_ip()))}

    def placement(self) -> dict[str, Any]:
        """Where this actor landed: node address and id, Ray's GPU ids, ``CUDA_VISIBLE_DEVICES``."""
        return actor_placement()


def actor_placement() -> dict[str, Any]:
    """The calling actor's node address, node id, Ray-assigned GPU ids and ``CUDA_VISIBLE_DEVICES``."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_ip": node_ip(),
        "node_id": ctx.get_node_id(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


class TrainerGroup:
    """One :class:`TrainerWorker` Ray actor per trainer rank of ``plan``, with the calls the loop makes.

    Every rank gets every call (collectives inside the backend need all ranks; ``train_step`` the whole batch, of
    which each data-parallel rank trains on its shard); metrics, weight updates and
    checkpoints are rank 0's (the backend gathers onto and writes from rank 0, as Megatron's backend does).

    :param config: the run's configuration (each rank's :class:`TrainerWorker` gets it).
    :param model_path: HF directory of the policy.
    :param plan: the placement plan (its ``trainer`` slots).
    :param pg: the plan's placement group (``None`` in a plan without bundles).
    """

    def __init__(self, config: RunConfig, model_path: Path, plan: PlacementPlan, pg: Any) -> None:
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
            .remote(config, str(model_path), rank, self.world_size, rendezvous)
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


#: the environment of Ray's worker processes (the trainer, the rollout manager, engine actors): no tqdm bars, whose
#: carriage-return redraws Ray forwards to the driver's log one line each
QUIET_WORKER_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_worker_output(stderr_is_tty: bool) -> dict[str, str]:
    """Set, in this process's environment, :data:`QUIET_WORKER_ENV` and, when the driver's stderr is not a terminal
    (a log file, CI), ``RAY_COLOR_PREFIX=0`` (Ray then writes its ``(Actor pid=N)`` prefixes without ANSI colour
    codes). Values the user set are kept. :return: the worker variables now set."""
    wanted = dict(QUIET_WORKER_ENV)
    if not stderr_is_tty:
        wanted["RAY_COLOR_PREFIX"] = "0"
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in QUIET_WORKER_ENV}


def init_ray(num_cpus: int | None = None, address: str | None = None, worker_niceness: int = 0) -> None:
    """Start a local Ray instance bound to 127.0.0.1, or join the running cluster at ``address`` (idempotent).

    :param num_cpus: CPUs of the local instance (default: every core); ignored when joining.
    :param worker_niceness: niceness of the local instance's worker processes (Ray's ``worker_niceness`` system
        config; Ray's default is 15, which lets every other process on the machine preempt the trainer and the
        engines); ignored when joining (the cluster's ``ray start`` decides, via ``RAY_worker_niceness``).
    :param address: ``host:port`` of a running cluster's GCS, ``ray://…``, or ``auto`` (read ``RAY_ADDRESS``).
    :raises RuntimeError: if Ray was imported before ``vime_core`` with cluster mode on (it would pick the machine's
        interface address instead of 127.0.0.1), or ``auto`` without ``RAY_ADDRESS``.
    :raises ConnectionError: if no cluster answers at ``address`` (Ray's message).
    """
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    # a local instance's workers inherit this environment; a joined cluster's workers have `ray start`'s
    quiet_worker_output(sys.stderr.isatty())
    if address:
        if address == "auto":
            address = os.environ.get("RAY_ADDRESS")
            if not address:
                raise RuntimeError("--ray-address auto: the RAY_ADDRESS environment variable is not set")
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return
    if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "1":
        raise RuntimeError("Ray was imported before vime_core: import vime_core first so Ray stays on 127.0.0.1")
    ray.init(
        address="local",  # a new instance even when RAY_ADDRESS is set: joining takes --ray-address
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        _system_config={"worker_niceness": worker_niceness},
    )


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the connected cluster (whole GPUs each), the driver's node flagged."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return [
        NodeResources(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)), n["NodeID"] == here)
        for n in ray.nodes()
        if n.get("Alive")
    ]


def create_placement_group(plan: PlacementPlan, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Any:
    """Reserve the plan's bundles (``{"GPU": n}`` each, pinned to the planned node); ``None`` for a plan without.

    :raises PlacementError: if Ray cannot place them within ``timeout_s`` seconds (the plan is in the message).
    """
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group

    if not plan.bundles:
        return None
    pg = placement_group(
        [{"GPU": float(b.gpus)} for b in plan.bundles],
        strategy="PACK",
        name="",
        bundle_label_selector=[{NODE_ID_LABEL_KEY: b.node_id} for b in plan.bundles],
    )
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place the plan's bundles within {timeout_s:g} s (GPUs in use by another job?):\n"
            + plan.describe()
        )
    return pg


def slot_options(slot: Slot, pg: Any, gpu_share: float | None = None) -> dict[str, Any]:
    """Ray actor options that put an actor on ``slot``: its first bundle with the slot's GPU share, or — for a slot
    without a bundle — the driver's node (hard node affinity) with no GPU and ``num_cpus=0``.

    :param gpu_share: override the GPU share (a probe that must fit beside the real tenant).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if not slot.bundles:
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=slot.bundles[0])
    share = slot.num_gpus if gpu_share is None else gpu_share
    return {"num_cpus": 0, "num_gpus": share, "scheduling_strategy": strategy}


def bundle_gpu_ids(plan: PlacementPlan, pg: Any) -> list[list[str]]:
    """The GPU ids Ray assigned to each bundle, read by a short-lived probe actor on it (slime's ``InfoActor``).

    :return: one list per bundle (empty for a plan without bundles).
    """
    import ray

    probes = []
    for b in plan.bundles:
        slot = Slot(f"probe {b.index}", b.node_id, b.node_ip, [b.index], float(b.gpus))
        probes.append(ray.remote(RendezvousProbe).options(**slot_options(slot, pg)).remote())
    found = ray.get([p.placement.remote() for p in probes])
    for p in probes:
        ray.kill(p)
    return [f["gpu_ids"] for f in found]


def remote_actor(cls: type, *args: Any, node_id: str | None = None) -> Any:
    """Create ``cls(*args)`` as a Ray actor taking no CPU slot (on node ``node_id`` when given, hard affinity)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(cls).options(**options).remote(*args)


def place(cfg: ClusterConfig) -> tuple[PlacementPlan, Any]:
    """Plan the run (its cluster flags) on the connected cluster and reserve the plan's placement group.

    Fills each bundle's ``gpu_ids`` (Ray's, read by probes; :func:`bundle_gpu_ids`).

    :return: ``(plan, placement_group)`` (``None`` for a plan without bundles).
    :raises PlacementError: an impossible plan (names the flag) or one Ray cannot place.
    """
    plan = plan_placement(ResourceFlags.from_config(cfg), cluster_nodes())
    pg = create_placement_group(plan)
    if pg is not None:
        for b, ids in zip(plan.bundles, bundle_gpu_ids(plan, pg), strict=True):
            b.gpu_ids = ids
    return plan, pg


def driver_node_id() -> str:
    """The Ray node id of the driver (the router runs here)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def call(actor: Any, method: str, *args: Any, wait: Callable[[Any], Any] | None = None) -> Any:
    """``actor.method(*args)``'s result: a Ray actor handle is called remotely and waited for (``wait``, default
    ``ray.get``: the loop passes one that updates the progress bar meanwhile); any other object — the same classes
    used in-process (tests, notebooks) — is called directly.

    :raises Exception: whatever the method raised (a Ray task error wraps it).
    """
    import ray
    from ray.actor import ActorHandle

    if isinstance(actor, ActorHandle):
        return (wait or ray.get)(getattr(actor, method).remote(*args))
    return getattr(actor, method)(*args)


class ComponentFailedError(RuntimeError):
    """An actor of the run (the rollout manager, a trainer rank) failed or died while the run was being set up; the
    message names it and carries its own error."""


def actor_error(e: BaseException) -> str:
    """The actor's own error behind a Ray error: a task's exception (``cause``), or for an actor whose
    ``__init__`` raised, the last line of the traceback Ray kept (``OSError: ...``); else ``str(e)``."""
    import re

    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    msg = re.sub(r"\x1b\[[0-9;]*m", "", getattr(e, "error_msg", None) or str(e))
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def wait_setup(calls: dict[str, Any]) -> dict[str, Any]:
    """Wait for every named ``ObjectRef`` of ``calls`` together, so that whichever actor fails first ends the wait
    at once (a trainer that cannot load its model does not wait for the engines to be ready).

    :return: ``{name: result}``.
    :raises ComponentFailedError: naming the first call that failed, with the actor's own error.
    """
    import ray

    pending = {ref: name for name, ref in calls.items()}
    results: dict[str, Any] = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            name = pending.pop(ref)
            try:
                results[name] = ray.get(ref)
            except ray.exceptions.RayError as e:
                raise ComponentFailedError(f"{name} failed during setup: {actor_error(e)}") from None
    return results


def stop_actors(rollout: Any, trainer: TrainerGroup | None, timeout_s: float = 120.0) -> None:
    """Stop the rollout manager (engines, router, producer) — gracefully within ``timeout_s``, then by killing it —
    and the trainer ranks; never raises.

    Killing the manager takes its engine actors along, and each engine's guard
    (:mod:`vime_core.rollout.process_guard`) stops every process of its server, so a short ``timeout_s`` (after a
    signal, or a setup that failed while the manager was still starting the engines) leaves nothing running.
    """
    import ray

    if rollout is not None:
        try:
            ray.get(rollout.shutdown.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("the rollout manager did not stop within %.0f s: killing it", timeout_s)
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to report
            logger.warning("rollout shutdown: %s", e)
        ray.kill(rollout)
    if trainer is not None:
        trainer.shutdown()
