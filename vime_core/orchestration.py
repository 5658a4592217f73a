"""Ray orchestration: the rollout manager and the trainer run as Ray actors on a local, loopback-only cluster.

Ray listens on the machine's interface address by default; with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and
``_node_ip_address="127.0.0.1"`` every Ray process (GCS, raylet, workers) binds and talks on 127.0.0.1 only.
Actors take ``num_cpus=0``: on a 2-core machine the vLLM engines and the trainer share the cores anyway, and
Ray's CPU accounting would only deadlock them.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from vime_core.plugins import get_plugins  # importing vime_core set Ray's loopback environment (see __init__)
from vime_core.weight_sync.base import WeightUpdate

logger = logging.getLogger("vime.orchestration")


class TrainerWorker:
    """Hosts a trainer backend and the trainer side of the weight-sync strategy (a Ray actor in ``vime run``)."""

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        if getattr(args, "train_cpus", None):  # before the backend starts torch's thread pool (threads inherit it)
            from vime_core.arguments import parse_cpu_list

            os.sched_setaffinity(0, parse_cpu_list(args.train_cpus))
        plugins = get_plugins()
        self.backend = plugins.resolve("trainer", args.trainer)(args, Path(model_path))
        self.weight_sync = plugins.resolve("weight_sync", args.weight_sync)(args)

    def train_step(self, batch: Any) -> dict[str, float]:
        return self.backend.train_step(batch)

    def push_weights(self, version: int) -> WeightUpdate:
        return self.weight_sync.push(self.backend.named_hf_tensors(), version)

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(Path(path))

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(Path(path))

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(Path(path))


def init_ray(num_cpus: int | None = None) -> None:
    """Start a local Ray instance bound to 127.0.0.1 (idempotent).

    :raises RuntimeError: if Ray was imported before ``vime_core`` with cluster mode on, so it would pick the
        machine's interface address instead of 127.0.0.1.
    """
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "1":
        raise RuntimeError("Ray was imported before vime_core: import vime_core first so Ray stays on 127.0.0.1")
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )


def remote_actor(cls: type, *args: Any) -> Any:
    """Create ``cls(*args)`` as a Ray actor taking no CPU slot."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1)(cls).remote(*args)


def call(actor: Any, method: str, *args: Any) -> Any:
    """``actor.method(*args)``'s result: a Ray actor handle is called remotely and waited for (``ray.get``); any
    other object — the same classes used in-process (tests, notebooks) — is called directly.

    :raises Exception: whatever the method raised (a Ray task error wraps it).
    """
    import ray
    from ray.actor import ActorHandle

    if isinstance(actor, ActorHandle):
        return ray.get(getattr(actor, method).remote(*args))
    return getattr(actor, method)(*args)
