"""Fully-async admission is version-aware: exact admission counts per weight version, fair treatment of slow
prompts, and a skipped step that does not advance the weight version.

The rollout manager, its background producer, the loop's step function (``vime_core.run.step.one_step``), the torch
trainer and the ``disk`` weight sync are the real ones, in-process; only the engines are replaced by a generate
function that sleeps (no engine is started, so a weight update reaches zero engines).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.async_rollout import (
    FAST_S,
    SLOW_FACTOR,
    async_manager,
    async_run_args,
    push_update,
    sleeping_generate,
)
from vime_core.config import RolloutConfig, RunConfig
from vime_core.plugins.manager import get_plugins
from vime_core.run.debug_rollout import load_debug_rollout
from vime_core.run.preflight import trainer_classes
from vime_core.run.step import one_step as _one_step
from vime_core.run.step_source import GroupSource as _GroupSource
from vime_core.trainer.group import TrainerWorker
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit


def test_admission_is_bounded_by_the_weight_version(tiny_model_dir, tmp_path):
    """batch 4, n 1, max-staleness 1: 8 groups before the first update, 4 after each (was 12, 4, 8, 4, 4, 8)."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path)
    m, _ = async_manager(tiny_model_dir, tmp_path, sleeping_generate, overrides)
    m.start_async()
    try:
        assert m.groups.producer.admitted_by_version == {0: 8}
        time.sleep(5 * FAST_S * SLOW_FACTOR)  # every admitted group has finished: still no more admitted
        assert m.groups.producer.admitted_by_version == {0: 8}
        for step in range(6):
            groups, metrics = m.get_async_groups(step, step)
            assert len(groups) == 4 and metrics["rollout/staleness_max"] <= 1.0
            assert m.groups.producer.admitted_by_version == {0: 8, **{v: 4 for v in range(1, step + 1)}}
            push_update(m, step + 1)
            assert m.groups.producer.admitted_by_version == {0: 8, **{v: 4 for v in range(1, step + 2)}}
        assert metrics["rollout/async_admitted_groups"] == 28.0
    finally:
        m.shutdown()


def test_admission_after_a_resume_at_a_later_version(tiny_model_dir, tmp_path):
    """A run resumed at version 5: 8 groups before its first update, not (1 + 5 + 1) x 4 = 28."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path)
    m, _ = async_manager(tiny_model_dir, tmp_path, sleeping_generate, overrides)
    push_update(m, 5)  # what the loop does on resume before starting the producer
    m.start_async()
    try:
        assert m.groups.producer.admitted_by_version == {5: 8}
        groups, _ = m.get_async_groups(10, 5)
        assert len(groups) == 4 and m.groups.producer.admitted_by_version == {5: 8}
        push_update(m, 6)
        assert m.groups.producer.admitted_by_version == {5: 8, 6: 4}
        groups, metrics = m.get_async_groups(11, 6)
        assert metrics["rollout/staleness_max"] <= 1.0
        push_update(m, 7)
        assert m.groups.producer.admitted_by_version == {5: 8, 6: 4, 7: 4}
    finally:
        m.shutdown()


def _trainer(args, tiny_model_dir):
    cfg = RunConfig.from_args(args)
    return TrainerWorker(cfg, tiny_model_dir, trainer_classes(get_plugins(), cfg))


def test_slow_prompts_get_a_fair_share_over_20_steps(tiny_model_dir, tmp_path):
    """Half the prompts take 3x as long. Every group admitted is trained exactly once (none dropped, none
    regenerated) except those still pending at the end, so the slow prompts are half of what is trained."""
    args, overrides = async_run_args(tiny_model_dir, tmp_path, stale_policy="regenerate")
    m, box = async_manager(tiny_model_dir, tmp_path, sleeping_generate, overrides)
    trainer = _trainer(args, tiny_model_dir)
    estimator = get_plugins().resolve("advantage", args.advantage_estimator)
    source = _GroupSource(RolloutConfig.from_args(args), m)
    m.start_async()
    trained: list[str] = []
    version, history = 0, []
    try:
        for step in range(20):
            metrics, version = _one_step(RunConfig.from_args(args), step, source, m, trainer, estimator, version)
            history.append(metrics)
            trained += [s.prompt for s in _batch(args, step)]
        producer = m.groups.producer
        pending = [g[0].prompt for g in list(producer.inflight.values()) + list(producer.ready.values())]
    finally:
        m.shutdown()
    assert version == 20
    assert [h["weight_sync/version"] for h in history] == [float(v) for v in range(1, 21)]
    assert sum(h["rollout/stale_dropped"] for h in history) == 0.0
    assert sum(h["rollout/stale_regenerated"] for h in history) == 0.0
    assert max(h["rollout/staleness_max"] for h in history) == 1.0
    assert all(h["rollout/num_trained_samples"] == 4.0 for h in history)
    # admitted in data order p0..p7, p0..p7, ...: 8 + 20 x 4 = 88 groups; 80 trained, 8 pending, each once
    assert m.groups.producer.admitted_by_version == {0: 8, **{v: 4 for v in range(1, 21)}}
    assert sorted(trained + pending) == sorted(f"p{i % 8}" for i in range(88))
    assert len(box["calls"]) == 88  # no prompt was generated twice
    slow = sum(int(p[1:]) % 2 for p in trained)
    assert 36 <= slow <= 44, slow  # at most the 8 pending groups away from exactly half of 80


def _batch(args, step) -> list[Sample]:
    """The samples the loop's step ``step`` took (its ``--save-debug-rollout-data`` file)."""
    return [s for g in load_debug_rollout(args.save_debug_rollout_data, step) for s in g]


def test_a_skipped_step_does_not_advance_the_weight_version(tiny_model_dir, tmp_path):
    """Step 0's four groups (the fast prompts) have no trainable token: nothing is trained and no weights are pushed,
    so step 1 runs at version 0 again, its update makes version 1, and step 0's groups are dropped as
    ``untrained_step``: their places are given back to the admission budget and their prompts to the data buffer."""
    args, overrides = async_run_args(tiny_model_dir, tmp_path)
    nothing = {"p0", "p2", "p4", "p6"}  # the fast ones: the first four to finish
    gen = lambda box: sleeping_generate(box, untrainable_once=nothing)  # noqa: E731
    m, box = async_manager(tiny_model_dir, tmp_path, gen, overrides)
    trainer = _trainer(args, tiny_model_dir)
    estimator = get_plugins().resolve("advantage", args.advantage_estimator)
    source = _GroupSource(RolloutConfig.from_args(args), m)
    pushed: list[int] = []
    push = trainer.push_weights
    trainer.push_weights = lambda v: pushed.append(v) or push(v)
    m.start_async()
    try:
        metrics0, v0 = _one_step(RunConfig.from_args(args), 0, source, m, trainer, estimator, 0)
        assert (v0, pushed, m.weight_version) == (0, [], 0)
        assert metrics0["rollout/failed_frac"] == 0.0 and metrics0["rollout/num_trained_samples"] == 0.0
        assert "weight_sync/version" not in metrics0
        metrics1, v1 = _one_step(RunConfig.from_args(args), 1, source, m, trainer, estimator, v0)
        assert (v1, pushed, m.weight_version) == (1, [1], 1)
        assert metrics1["weight_sync/version"] == 1.0 and metrics1["rollout/staleness_max"] == 0.0
        assert [s.status for s in _batch(args, 1)] == [Status.COMPLETED] * 4
        assert metrics1["rollout/async_dropped/untrained_step"] == 4.0
        # 8 at start, 4 more at version 0 once step 0's untrained groups gave their places back, 4 at version 1
        assert m.groups.producer.admitted_by_version == {0: 12, 1: 4}
        # the dropped prompts came back from the data buffer first: they were generated twice
        assert box["calls"][:12] == [f"p{i}" for i in range(8)] + ["p0", "p2", "p4", "p6"]
    finally:
        m.shutdown()


def test_take_order_prefers_groups_that_would_go_stale(tiny_model_dir, tmp_path):
    """A group admitted at version u - max_staleness is taken at version u even if newer ones finished first."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path)
    m, _ = async_manager(tiny_model_dir, tmp_path, lambda box: sleeping_generate(box, fast_s=0.1), overrides)
    m.start_async()
    try:
        first, _ = m.get_async_groups(0, 0)
        assert [g[0].prompt for g in first] == ["p0", "p2", "p4", "p6"]  # the fast ones finished first
        push_update(m, 1)
        second, metrics = m.get_async_groups(1, 1)
        # the slow version-0 groups must be trained now: they are waited for although p0/p2 of version 1 are done
        assert [g[0].prompt for g in second] == ["p1", "p3", "p5", "p7"]
        assert metrics["rollout/staleness_max"] == 1.0
    finally:
        m.shutdown()


def test_sample_versions_come_from_the_engine_version(tiny_model_dir, tmp_path):
    """Sanity of the fake generation used above: tokens carry the manager's version at the time they appear."""
    s = Sample(prompt="p1")
    box = {"m": type("M", (), {"weight_version": 3})()}
    out = asyncio.run(sleeping_generate(box)(None, s, {}))
    assert out.weight_versions == [3, 3] and out.tokens == [1, 2, 4, 5, 6]
