"""A sandbox's resource limits (:class:`SandboxLimits`) and its constructor keywords from the run's configuration:
the generic ``--sandbox-*`` flags (:func:`sandbox_kwargs`) and a backend's own ``--sandbox-NAME-*`` flags
(:func:`backend_kwargs`, driven by :attr:`~vime_core.sandbox.base.Sandbox.FLAG_KWARGS`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vime_core.config import SandboxConfig


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox. ``None`` means "no limit from vime" (the backend's own default applies).

    :ivar cpus: CPU share in cores (e.g. ``0.5``), enforced as a quota where the backend can.
    :ivar memory_bytes: memory limit in bytes for all processes of the sandbox together.
    :ivar disk_bytes: disk limit in bytes (backends without a quota enforce it as the maximum size of one file).
    :ivar pids: maximum number of processes/threads in the sandbox.
    :ivar wall_time_s: lifetime of the sandbox in seconds; at the limit everything in it is killed.
    :ivar max_output_bytes: bytes kept of each of stdout and stderr per ``exec`` (the rest is read and dropped).
    :ivar open_files: maximum open file descriptors per process.
    :raises ValueError: on a non-positive limit.
    """

    cpus: float | None = 1.0
    memory_bytes: int | None = 1 << 30
    disk_bytes: int | None = 1 << 30
    pids: int | None = 512
    wall_time_s: float | None = 3600.0
    max_output_bytes: int = 1 << 20
    open_files: int | None = 4096

    def __post_init__(self) -> None:
        for name in ("cpus", "memory_bytes", "disk_bytes", "pids", "wall_time_s", "max_output_bytes", "open_files"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive or None, got {value!r}")


def sandbox_kwargs_from_config(cfg: SandboxConfig | None) -> dict[str, Any]:
    """:func:`sandbox_kwargs` of ``cfg``; ``{}`` for ``None`` (a caller outside a run: the backend's defaults)."""
    return {} if cfg is None else sandbox_kwargs(cfg)


def sandbox_kwargs_from_args(args: Any) -> dict[str, Any]:
    """Deprecated, goes in vime 0.2 (use :func:`sandbox_kwargs_from_config`): :func:`sandbox_kwargs` of the sandbox
    section of a ``vime run`` Namespace; ``{}`` when ``args`` is ``None`` or has none of the sandbox flags."""
    _deprecated("sandbox_kwargs_from_args(args)", "sandbox_kwargs_from_config(ctx.sandbox)")
    if args is None or not hasattr(args, "sandbox_cpus"):
        return {}
    return sandbox_kwargs(SandboxConfig.from_args(args))


def sandbox_kwargs(cfg: SandboxConfig) -> dict[str, Any]:
    """``limits``, ``network`` and ``default_timeout_s`` from the generic flags ``--sandbox-cpus``,
    ``--sandbox-memory-mb``, ``--sandbox-disk-mb``, ``--sandbox-pids``, ``--sandbox-wall-time``,
    ``--sandbox-max-output-bytes``, ``--sandbox-network``, ``--sandbox-exec-timeout`` (0 = no limit).
    """

    def limit(value: Any, scale: float = 1.0) -> Any:
        """``None`` for 0 (no limit), else the value (times ``scale``, in the value's type)."""
        return None if not value else type(value)(value * scale) if scale != 1.0 else value

    limits = SandboxLimits(
        cpus=limit(cfg.sandbox_cpus),
        memory_bytes=limit(cfg.sandbox_memory_mb, 1 << 20),
        disk_bytes=limit(cfg.sandbox_disk_mb, 1 << 20),
        pids=limit(cfg.sandbox_pids),
        wall_time_s=limit(cfg.sandbox_wall_time),
        max_output_bytes=limit(cfg.sandbox_max_output_bytes) or SandboxLimits.max_output_bytes,
    )
    out: dict[str, Any] = {"limits": limits, "network": bool(cfg.sandbox_network)}
    if cfg.sandbox_exec_timeout:
        out["default_timeout_s"] = float(cfg.sandbox_exec_timeout)
    return out


def backend_kwargs(flags: Any, mapping: Mapping[str, str]) -> dict[str, Any]:
    """A backend's own ``--sandbox-NAME-*`` flags as constructor keywords: ``mapping`` maps an attribute of
    ``flags`` (the backend's flag dataclass) to the keyword; flags left unset (``None``, empty) and ``flags`` ``None``
    give nothing, so the constructor's defaults apply."""
    if flags is None:
        return {}
    return {kw: getattr(flags, attr) for attr, kw in mapping.items() if getattr(flags, attr, None)}


def backend_kwargs_from_args(flags: Any, mapping: Mapping[str, str]) -> dict[str, Any]:
    """Deprecated name of :func:`backend_kwargs` (it read a ``vime run`` Namespace, which has the same attributes);
    goes in vime 0.2."""
    _deprecated("backend_kwargs_from_args", "backend_kwargs")
    return backend_kwargs(flags, mapping)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"vime_core.sandbox.{old} is deprecated and goes in vime 0.2: use {new}", DeprecationWarning, stacklevel=3
    )


def remote_lifetime_s(limits: SandboxLimits, grace_s: int, max_s: int) -> int:
    """Seconds of life to ask a hosted sandbox service for (E2B ``timeout``, Modal ``timeout``): the wall time
    rounded up plus ``grace_s`` (vime enforces the wall time itself; the service's own limit is the backstop when
    vime is killed), at most ``max_s`` (the service's longest lifetime), ``max_s`` without a wall time."""
    wall = limits.wall_time_s
    return max_s if wall is None else min(max_s, math.ceil(wall) + grace_s)
