"""Ray orchestration: the cluster ``vime run`` runs on, the placement group of its plan, and the actors' options.

:func:`init_ray` starts a loopback-only single-node Ray or joins ``--ray-address``; :func:`create_placement_group`
and :func:`slot_options` reserve and use the bundles of a :class:`~vime_core.cluster.placement.PlacementPlan` (Ray
picks the GPUs); the trainer ranks use them from :mod:`vime_core.trainer.group`. What runs where: docs/cluster.md.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from vime_core.cluster.net import find_free_port, node_ip
from vime_core.cluster.placement import (
    NodeResources,
    PlacementError,
    PlacementPlan,
    ResourceFlags,
    Slot,
    plan_placement,
)
from vime_core.config import ClusterConfig

logger = logging.getLogger("vime.orchestration")

#: seconds to wait for Ray to place a plan's bundles (the plan already fits the cluster's totals)
PLACEMENT_TIMEOUT_S = 120.0


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


def stop_actors(rollout: Any, trainer: Any, timeout_s: float = 120.0) -> None:
    """Stop the rollout manager (engines, router, producer) — gracefully within ``timeout_s``, then by killing it —
    and the trainer ranks (``trainer``: a :class:`~vime_core.trainer.group.TrainerGroup` or ``None``); never
    raises.

    Killing the manager takes its engine actors along, and each engine's guard
    (:mod:`vime_core.engines.process_guard`) stops every process of its server, so a short ``timeout_s`` (after a
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
