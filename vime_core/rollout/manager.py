"""The rollout manager: the rollout actor's face, composed of two parts, each built with its collaborators.

* :class:`~vime_core.engines.fleet.EngineFleet`: engines, router, router client, health monitor and weight
  recovery, LoRA adapters, teacher engines; weight updates.
* :class:`~vime_core.rollout.group_producer.GroupProducer`: the group runner, over-sampling, the fully-async
  producer and its admission, evaluations, and the data buffer (:class:`~vime_core.data.source.DataSource`) it
  draws from and checkpoints; the manager builds the buffer and keeps no reference to it.

It runs as a Ray actor in ``vime run`` (see :mod:`vime_core.cluster.orchestration`) but is a plain class, usable
without Ray (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from vime_core.config import RunConfig
from vime_core.config.context import Engines, PluginContext
from vime_core.data.prompt_checks import filter_overlong_prompts
from vime_core.data.source import DataSource, read_rows
from vime_core.engines.fleet import EngineFleet
from vime_core.plugins.manager import get_plugins
from vime_core.rollout.evaluation import load_eval_sets
from vime_core.rollout.group_producer import GroupProducer
from vime_core.rollout.runner import GroupRunner
from vime_core.types import Sample
from vime_core.weight_sync.base import WeightUpdate

logger = logging.getLogger("vime.rollout")


class RolloutManager:
    """Engines + router + buffer; produces scored groups and applies weight updates.

    :param config: the run's configuration; the manager reads its sections ``config`` (its
        :class:`~vime_core.config.RolloutConfig`), ``engine_config``, ``eval_config``, ``data`` and ``lora``, and
        hands ``ctx`` (a :class:`~vime_core.config.context.PluginContext` of it, with the fleet's engines and the
        loaded plugins) to the plugin functions and hooks.
    :param model_path: HF directory the engines serve (and whose tokenizer prompts are encoded with).
    :param placement: ``(plan, placement_group)`` from :mod:`vime_core.cluster.orchestration`: each engine
        is then started by an engine actor on its bundle (:mod:`vime_core.engines.engine_actor`); ``None``: engines
        are subprocesses of this process (tests, notebooks).
    :param progress: a :class:`vime_core.run.progress.RolloutProgress` actor told how many samples of
        :meth:`generate` have finished (for the live progress bar), or ``None``.
    """

    def __init__(
        self, config: RunConfig, model_path: Path, placement: tuple | None = None, progress: Any = None
    ) -> None:
        from transformers import AutoTokenizer

        self.config = cfg = config.rollout
        self.engine_config = config.engine
        self.eval_config = eval_cfg = config.eval
        data = config.data
        self.model_path = Path(model_path)
        plugins = get_plugins()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        # what plugin functions see of the engines (the fleet fills in the router client when it starts)
        self.engines = Engines(tokenizer=self.tokenizer)
        self.ctx = PluginContext(config, engines=self.engines, plugins=plugins)  # passed to plugin functions, hooks
        group_reward = cfg.group_reward
        self.hook = plugins.pm.hook
        # generates and scores groups; over-sampling and the fully-async producer drive it too
        self.runner = GroupRunner(
            self.ctx,
            generate_fn=plugins.resolve("generate", cfg.generate),
            reward_fn=plugins.resolve("reward", cfg.reward),
            hook=self.hook,
            group_reward_fn=plugins.resolve("group_reward", group_reward) if group_reward else None,
            progress=progress,
        )
        self.weight_sync = plugins.resolve("weight_sync", self.engine_config.weight_sync)(config)
        name = cfg.dynamic_sampling_filter
        self.dynamic_filter = plugins.resolve("dynamic_filter", name) if name else None
        data_source = None  # `vime eval` has no training data
        if data.prompt_data is not None:
            rows = read_rows(
                data.prompt_data, data.input_key, data.label_key, data.metadata_key, image_key=data.image_key
            )
            data_source = DataSource(
                filter_overlong_prompts(rows, self.tokenizer, data)[0],  # --rollout-max-prompt-len
                cfg.n_samples_per_prompt,
                shuffle=data.rollout_shuffle,
                seed=data.seed,
            )
        # held-out eval sets (--eval-prompt-data): read once, never part of the training buffer
        self.eval_sets = load_eval_sets(eval_cfg)
        default_eval_reward = eval_cfg.eval_reward or eval_cfg.reward
        per_set = eval_cfg.eval_set_reward or {}  # --eval-set-reward NAME REWARD: that set's own reward function
        self.eval_reward_fns = {
            s.name: plugins.resolve("reward", per_set.get(s.name, default_eval_reward)) for s, _ in self.eval_sets
        }
        self.loop = asyncio.new_event_loop()
        self.fleet = EngineFleet(
            self.engine_config,
            config.lora,
            self.model_path,
            self.tokenizer,
            self.weight_sync,
            placement,
            stream=bool(cfg.partial_rollout),  # partial rollout: an aborted non-streamed request has no tokens
            loop=self.loop,
            engines=self.engines,
        )
        self.groups = GroupProducer(
            self.ctx,
            cfg,
            eval_cfg,
            self.runner,
            data_source,
            self.eval_sets,
            self.eval_reward_fns,
            self.dynamic_filter,
            self.hook,
            self.fleet,
            self.loop,
        )

    @property
    def weight_version(self) -> int:
        """The weight version the engines serve (``ctx.engines``' one holder, which the fleet updates and the group
        runner and the router client read)."""
        return self.engines.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.engines.weight_version = version

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the engines (in parallel) and the router (or attach to ``--vllm-router-ip/port``); see
        :meth:`EngineFleet.start <vime_core.engines.fleet.EngineFleet.start>`. The group runner then scores with the
        teacher engines and regenerates under the health monitor."""
        info = self.fleet.start(self.weight_version)
        self.runner.teacher = self.fleet.teacher
        self.runner.monitor = self.fleet.monitor
        return info

    def shutdown(self) -> None:
        """Stop the health monitor, the async producer, the router (or deregister from an external one) and every
        engine; never raises."""
        self.fleet.stop_monitor()
        self.groups.stop()
        self.fleet.shutdown()

    # -- rollout ---------------------------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``--rollout-batch-size`` scored groups for ``step``
        (:meth:`GroupProducer.generate <vime_core.rollout.group_producer.GroupProducer.generate>`)."""
        return self.groups.generate(step)

    def start_async(self) -> None:
        """``--loop fully-async``: start generating in the background
        (:meth:`GroupProducer.start_async <vime_core.rollout.group_producer.GroupProducer.start_async>`)."""
        self.groups.start_async()

    def get_async_groups(self, step: int, current_version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``--loop fully-async``: the next batch of groups within ``--max-staleness`` of ``current_version``
        (:meth:`GroupProducer.get_async_groups <vime_core.rollout.group_producer.GroupProducer.get_async_groups>`)."""
        return self.groups.get_async_groups(step, current_version)

    # -- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Generate and score every ``--eval-prompt-data`` set at the engines' current weight version
        (:meth:`GroupProducer.evaluate <vime_core.rollout.group_producer.GroupProducer.evaluate>`)."""
        return self.groups.evaluate(step)

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        """Pause every engine, apply ``update``, reset prefix caches, resume; then bump the weight version (and, in
        ``--loop fully-async``, admit the groups the new version allows before returning).

        :return: ``weight_sync/*`` metrics (seconds, bytes; ``weight_sync/full_bytes``, the bytes of the whole
            version, where the strategy reports them in its payload, as ``disk-delta`` does).
        :raises TimeoutError / RuntimeError: from the strategy or the engine (the run stops; the engines keep
            their previous version).
        """
        t0 = time.perf_counter()
        # fully-async: freeze in-flight requests (they continue on the new weights); else let them finish first
        mode = "keep" if self.groups.fully_async else "wait"
        extra = self.fleet.update_weights(update, mode)
        self.groups.admit_now()
        metrics = {
            **extra,
            "weight_sync/engine_seconds": time.perf_counter() - t0,
            "weight_sync/trainer_seconds": update.seconds,
            "weight_sync/bytes": float(update.num_bytes),
            "weight_sync/version": float(update.version),
        }
        if isinstance(update.payload.get("full_bytes"), int):  # disk-delta: what a full sync would move
            metrics["weight_sync/full_bytes"] = float(update.payload["full_bytes"])
        return metrics

    def sleep_engines(self) -> dict[str, float]:
        """``--colocate``: every engine frees its GPU memory for the trainer (:meth:`EngineFleet.sleep_engines
        <vime_core.engines.fleet.EngineFleet.sleep_engines>`: level 2 when the weight sync rewrites every weight).
        :return: ``perf/sleep_level``."""
        return self.fleet.sleep_engines()

    def wake_engines(self) -> dict[str, float]:
        """``--colocate``: every engine takes its GPU memory back before the weight update (:meth:`EngineFleet.
        wake_engines <vime_core.engines.fleet.EngineFleet.wake_engines>`). :return: its ``perf/wake_*`` split."""
        return self.fleet.wake_engines()

    def check_engines(self) -> None:
        """Raise if an engine is lost (:meth:`EngineFleet.check_engines
        <vime_core.engines.fleet.EngineFleet.check_engines>`)."""
        self.fleet.check_engines()

    def check_weight_dir(self, path: str, nonce: str) -> list[str]:
        """Whether every engine's node reads ``nonce`` from ``path`` (:meth:`EngineFleet.check_weight_dir
        <vime_core.engines.fleet.EngineFleet.check_weight_dir>`): one reason per engine that cannot."""
        return self.fleet.check_weight_dir(path, nonce)

    # -- state -----------------------------------------------------------------------------------------------------
    def data_state(self, unconsumed: list[list[Sample]] | None = None) -> dict[str, Any]:
        """The buffer state to save with a checkpoint (:meth:`GroupProducer.data_state
        <vime_core.rollout.group_producer.GroupProducer.data_state>`)."""
        return self.groups.data_state(unconsumed)

    def load_data_state(self, state: dict[str, Any]) -> None:
        """Restore the buffer state of a checkpoint."""
        self.groups.load_data_state(state)
