"""vLLM engines as Ray actors: each engine is started by an :class:`EngineActor` scheduled on its placement bundle.

The actor starts the :class:`~vime_core.engines.engine.VLLMServer` subprocess on its node, bound to the node's
address, with the GPU ids Ray assigned (and sleep mode when colocated); the rollout manager drives it over HTTP
through a :class:`RemoteEngine`, and :meth:`EngineActor.wait_exit` reports the server's exit (code and log tail) so
a dead engine fails the step at once. What runs where: docs/cluster.md, "What runs where".
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from vime_core.cluster.orchestration import actor_placement, slot_options
from vime_core.cluster.placement import PlacementPlan
from vime_core.engines.engine import VLLMServer, VLLMServerError
from vime_core.engines.health import keep_log
from vime_core.engines.process import tail_file

logger = logging.getLogger("vime.rollout")


class EngineActor:
    """Starts and watches one vLLM server on this actor's node (a threaded Ray actor: ``wait_exit`` blocks).

    :param server_kwargs: keyword arguments of :class:`VLLMServer` (``model``, ``served_model_name``, ...).
    :param devices: GPU ids for ``CUDA_VISIBLE_DEVICES`` when the actor's own share does not cover the engine
        (colocated tensor parallel: Ray's ids of each of the engine's bundles); ``None``: ``ray.get_gpu_ids()``.
    :param tensor_parallel_size: passed as ``--tensor-parallel-size`` when the engine has GPUs.
    :param sleep_mode: pass ``--enable-sleep-mode`` (colocated engines sleep while the trainer trains) and, unless
        ``--vllm-gpu-memory-utilization`` is given, a memory share that fits beside the trainer
        (:func:`colocated_memory_utilization`).
    """

    def __init__(
        self,
        server_kwargs: dict[str, Any],
        devices: list[str] | None = None,
        tensor_parallel_size: int = 1,
        sleep_mode: bool = False,
    ) -> None:
        self.where = actor_placement()
        devices = devices if devices is not None else self.where["gpu_ids"]
        kwargs = dict(server_kwargs)
        env = dict(kwargs.pop("env", None) or {})
        extra = list(kwargs.pop("extra_args", None) or [])
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            if "--tensor-parallel-size" not in extra:
                extra += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if sleep_mode and "--enable-sleep-mode" not in extra:
            extra.append("--enable-sleep-mode")
        if sleep_mode and devices and not any(a.startswith("--gpu-memory-utilization") for a in extra):
            extra += ["--gpu-memory-utilization", f"{colocated_memory_utilization(devices):.2f}"]
        self.devices = list(devices)
        self.server = VLLMServer(host=self.where["node_ip"], env=env, extra_args=extra, **kwargs)
        self._stopped = threading.Event()

    def launch_spec(self) -> dict[str, Any]:
        """How the server is (or would be) launched here: ``command`` (argv), ``env`` (the variables vime sets on
        top of the actor's environment), ``url``, ``node_ip``, ``node_id``, ``gpu_ids`` (Ray's), ``devices``."""
        full = self.server.environment()
        env = {k: v for k, v in full.items() if os.environ.get(k) != v or k in self.server.extra_env}
        return {
            "command": self.server.command(),
            "env": env,
            "url": self.server.url,
            "port": self.server.port,
            "log_path": str(self.server.log_path),
            **self.where,
            "devices": self.devices,
        }

    def start(self) -> dict[str, Any]:
        """Start the server (returns at once) and return :meth:`launch_spec` plus its ``pid``."""
        self.server.start()
        return {**self.launch_spec(), "pid": self.server.proc.pid}

    def restart(self) -> int:
        """Stop what is left of the server, keep its log as ``<log>.exit<N>.log``, start it again on the same port,
        or on a fresh one if the old is still held (:meth:`VLLMServer.start_again`; returns at once, call
        :meth:`wait_ready`). :return: the port the server starts on."""
        self.server.stop()
        self.restarts = getattr(self, "restarts", 0) + 1
        keep_log(self.server.log_path, self.restarts)
        self._stopped.clear()
        return self.server.start_again()

    def wait_ready(self, timeout_s: float) -> float:
        """:meth:`VLLMServer.wait_ready` here. :raises VLLMServerError / TimeoutError: with the log tail."""
        return self.server.wait_ready(timeout_s)

    def wait_exit(self) -> dict[str, Any]:
        """Block until the server process exits; return ``{"returncode", "stopped", "log_tail", "node_ip", "url"}``
        (``stopped``: :meth:`stop` ended it, not a crash)."""
        proc = self.server.proc
        while proc is None and not self._stopped.is_set():
            time.sleep(0.2)
            proc = self.server.proc
        rc = proc.wait() if proc is not None else None
        return {
            "returncode": rc,
            "stopped": self._stopped.is_set(),
            "log_tail": tail_file(self.server.log_path),
            "node_ip": self.where["node_ip"],
            "url": self.server.url,
        }

    def can_read(self, path: str, nonce: str) -> str | None:
        """``None`` if ``path`` exists on this node and holds ``nonce``; else why not (the shared-filesystem check)."""
        return check_nonce(path, nonce)

    def stop(self) -> None:
        """Stop the server (its whole process group)."""
        self._stopped.set()
        self.server.stop()


#: share of a colocated engine's GPU memory, measured free at its start (the trainer already holds its weights and
#: optimizer state), that vLLM may take; the rest stays for the trainer's activations while the engine is awake
COLOCATED_FREE_SHARE = 0.8


def colocated_memory_utilization(devices: list[str], share: float = COLOCATED_FREE_SHARE) -> float:
    """``--gpu-memory-utilization`` (a fraction of total memory, as vLLM counts it) for a colocated engine:
    ``share`` of the memory free now on the fullest of ``devices`` (the smallest free fraction), read with
    ``nvidia-smi`` (no CUDA context in this actor). Falls back to 0.5 where ``nvidia-smi`` cannot say.

    vLLM refuses to start when its share of the total exceeds the free memory, and the trainer ranks on the same
    GPUs have finished loading before the engines start (:func:`vime_core.run.loop.run`).
    """
    import subprocess

    query = ["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run([*query, "-i", ",".join(devices)], capture_output=True, text=True, timeout=30).stdout
        rows = [tuple(float(x) for x in line.split(",")) for line in out.strip().splitlines() if line.strip()]
    except (OSError, ValueError, subprocess.SubprocessError):
        rows = []
    if not rows:
        logger.warning("nvidia-smi gave no memory figures for GPUs %s: colocated engine takes 0.5 of memory", devices)
        return 0.5
    fraction = min(free / total for free, total in rows)
    return max(0.05, min(0.9, round(fraction * share, 2)))


def check_nonce(path: str | Path, nonce: str) -> str | None:
    """``None`` if the file at ``path`` reads ``nonce``; else a reason (missing, or other content)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    return None if text == nonce else f"{path} holds {text[:40]!r}, not the nonce {nonce!r} just written"


class RemoteEngine(VLLMServer):
    """The rollout manager's handle on an engine run by an :class:`EngineActor`: the HTTP control plane of
    :class:`VLLMServer` against the server's node address, lifecycle calls forwarded to the actor.

    :param actor: the :class:`EngineActor` handle.
    :param spec: what :meth:`EngineActor.start` returned.
    :param index: engine number (for messages).
    """

    def __init__(self, actor: Any, spec: dict[str, Any], index: int, served_model_name: str, timeout_s: float):
        super().__init__(
            spec["command"][spec["command"].index("--model") + 1],
            host=spec["node_ip"],
            port=spec["port"],
            served_model_name=served_model_name,
            request_timeout_s=timeout_s,
        )
        self.actor, self.spec, self.index = actor, spec, index
        if spec.get("log_path"):
            self.log_path = Path(spec["log_path"])
        self.exit_ref = actor.wait_exit.remote()

    def restart(self) -> None:
        """Have the actor restart the server on its node (the same port, or a fresh one if the old is still held:
        :meth:`EngineActor.restart`; :attr:`url` follows)."""
        import ray

        port = ray.get(self.actor.restart.remote())
        if port != self.port:
            self.move_to_port(port)
        self.exit_ref = self.actor.wait_exit.remote()

    def exit_code(self) -> int | None:
        """The server's exit code once its actor reported the exit (``None`` while it runs, or if the actor died)."""
        import ray

        if not ray.wait([self.exit_ref], timeout=0)[0]:
            return None
        try:
            return ray.get(self.exit_ref)["returncode"]
        except ray.exceptions.RayError:
            return None

    def start(self) -> RemoteEngine:  # started by the actor
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        import ray

        try:
            elapsed = ray.get(self.actor.wait_ready.remote(timeout_s))
        except ray.exceptions.RayTaskError as e:
            raise VLLMServerError(f"engine {self.index} on {self.spec['node_ip']}: {e.cause}") from None
        self.capabilities = self.probe()
        return elapsed

    def death(self) -> str | None:
        """``None`` while the server runs (or after a deliberate stop); else the actor's report of its exit."""
        import ray

        if not ray.wait([self.exit_ref], timeout=0)[0]:
            return None
        try:
            info = ray.get(self.exit_ref)
        except ray.exceptions.RayError as e:  # the actor itself died (node lost)
            return f"engine {self.index} ({self.url}): its Ray actor died: {e}"
        if info["stopped"]:
            return None
        return (
            f"engine {self.index} ({info['url']} on node {info['node_ip']}) exited with code {info['returncode']}; "
            f"last lines of its log:\n{info['log_tail']}"
        )

    def is_running(self) -> bool:
        import ray

        return not ray.wait([self.exit_ref], timeout=0)[0]

    def _check_alive(self, what: str) -> None:
        report = self.death()
        if report is not None:
            raise VLLMServerError(f"{report} ({what})")

    def _post(self, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        try:
            return super()._post(path, json=json, params=params)
        except VLLMServerError:
            self._check_alive(f"during POST {path}")
            raise

    def stop(self, grace_s: float = 20.0) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=grace_s + 15)
        finally:
            ray.kill(self.actor)


def start_engine_actors(
    server_kwargs: list[dict[str, Any]],
    plan: PlacementPlan,
    pg: Any,
    timeout_s: float,
) -> list[RemoteEngine]:
    """Create one :class:`EngineActor` per engine slot of ``plan`` and start its server (not waiting for ready).

    :param server_kwargs: :class:`VLLMServer` keyword arguments per engine.
    :param plan: the placement plan; a colocated tensor-parallel engine, whose actor holds a share of one bundle
        but drives the GPUs of ``tp`` bundles, gets the GPU ids Ray assigned to those bundles (``Bundle.gpu_ids``).
    :param pg: the plan's placement group.
    :param timeout_s: control-plane HTTP timeout, seconds.
    """
    import ray

    engines = []
    for i, (slot, kwargs) in enumerate(zip(plan.engines, server_kwargs, strict=True)):
        devs = None
        if plan.mode == "colocated" and plan.tp > 1:
            devs = [d for b in slot.bundles for d in plan.bundles[b].gpu_ids]
        actor = (
            ray.remote(EngineActor)
            .options(**slot_options(slot, pg), max_concurrency=4, name=f"vime-engine-{i}-{uuid.uuid4().hex[:6]}")
            .remote(kwargs, devs, plan.tp, plan.mode == "colocated")
        )
        spec = ray.get(actor.start.remote())
        logger.info(
            "engine %d on %s (node %s, GPUs %s): %s",
            i,
            spec["node_ip"],
            spec["node_id"][:8],
            spec["devices"],
            " ".join(spec["command"]),
        )
        engines.append(RemoteEngine(actor, spec, i, kwargs.get("served_model_name") or "", timeout_s))
    return engines


def engine_failures(engines: list[Any]) -> list[str]:
    """The death reports of ``engines`` that are :class:`RemoteEngine` and have exited (local ones: none)."""
    return [r for e in engines if isinstance(e, RemoteEngine) and (r := e.death()) is not None]
