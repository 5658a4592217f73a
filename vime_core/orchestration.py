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

# Set before Ray is imported anywhere: Ray reads these at import time (ray_constants).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node IP = 127.0.0.1 instead of the interface's
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from vime_core.plugins import get_plugins  # noqa: E402
from vime_core.weight_sync.base import WeightUpdate

logger = logging.getLogger("vime.orchestration")


class TrainerWorker:
    """Hosts a trainer backend and the trainer side of the weight-sync strategy (a Ray actor in ``vime run``)."""

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
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
    """Start a local Ray instance bound to 127.0.0.1 (idempotent)."""
    import ray

    if ray.is_initialized():
        return
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
