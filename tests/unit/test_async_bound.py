"""Fully-async production is bounded and its counters add up (kind of slime #2238); systemic rollout failures end
the run in every loop mode, while a flake does not (kind of verl #6395).

The rollout manager and its background producer are the real ones, in-process; only the engines are replaced by a
generate function that sleeps (``tests/support/async_rollout.py``).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.async_rollout import async_manager, async_run_args, push_update, sleeping_generate
from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import parse_run_args
from vime_core.config.errors import ArgumentError
from vime_core.failures import RunFailedError
from vime_core.run.summary import failed_summary
from vime_core.types import Status

pytestmark = pytest.mark.unit

TRAINER_S = 0.3  # the "slow trainer": seconds between two steps (every admitted group finishes meanwhile)


def _counters_add_up(metrics: dict[str, float]) -> bool:
    parts = ("trained", "waiting", "running", "dropped")
    return metrics["rollout/async_admitted_groups"] == sum(metrics[f"rollout/async_{p}_groups"] for p in parts)


def test_production_stops_at_the_inflight_bound_with_unbounded_staleness(tiny_model_dir, tmp_path):
    """20 prompts x 2 samples, 2 groups per step, at most 6 groups in flight, staleness unbounded, a slow trainer,
    10 steps: 6 groups are generated and then production waits; each step the producer refills exactly what the
    trainer took, so after step k's take 6 + 2k groups were admitted (main: every finished group made room for a
    new one, ~6 + 30k); every prompt is trained exactly once and nothing is dropped."""
    _, overrides = async_run_args(
        tiny_model_dir,
        tmp_path,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        max_staleness=1000000,
        rollout_inflight_groups=6,
    )
    box: dict = {}
    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=sleeping_generate(box), num_prompts=20, **overrides)
    box["m"] = m
    m.start_async()
    trained: list[str] = []
    history = []
    try:
        time.sleep(TRAINER_S)  # every admitted group has finished: none more was admitted
        producer = m.groups.producer
        assert (producer.admitted_by_version, producer.budget.waiting, producer.budget.running) == ({0: 6}, 6, 0)
        for step in range(10):
            groups, metrics = m.get_async_groups(step, step)
            history.append(metrics)
            trained += [g[0].prompt for g in groups]
            assert [len(g) for g in groups] == [2, 2]
            time.sleep(TRAINER_S)  # training
            push_update(m, step + 1)
    finally:
        m.shutdown()
    assert [h["rollout/async_admitted_groups"] for h in history] == [6.0 + 2 * k for k in range(10)]
    assert [h["rollout/async_trained_groups"] for h in history] == [2.0 * (k + 1) for k in range(10)]
    assert [h["rollout/async_waiting_groups"] + h["rollout/async_running_groups"] for h in history] == [4.0] * 10
    assert all(_counters_add_up(h) for h in history), history
    assert [h["rollout/async_dropped_groups"] for h in history] == [0.0] * 10
    assert {h["rollout/async_peak_groups"] for h in history} == {6.0}  # the bound was reached, never exceeded
    assert {h["rollout/async_inflight_bound"] for h in history} == {6.0}
    assert sorted(trained) == sorted(f"p{i}" for i in range(20))  # every prompt exactly once
    # 24 groups of 2 samples for the 10 steps, and 2 more groups to refill after the last take: no more
    assert len(box["calls"]) == 26 * 2


def test_stale_groups_are_dropped_with_a_reason_and_their_prompts_return(tiny_model_dir, tmp_path, caplog):
    """Staleness 1, batch 2: the two groups left over from version 0 are taken at version 5 and are too old: both
    are dropped (reason 'stale', one log line each) and their prompts go back to the data buffer, which hands them
    out again before fresh prompts; the counters add up."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path, rollout_batch_size=2)
    m, box = async_manager(tiny_model_dir, tmp_path, lambda box: sleeping_generate(box, fast_s=0.0), overrides)
    m.start_async()
    try:
        first, m0 = m.get_async_groups(0, 0)
        assert [g[0].prompt for g in first] == ["p0", "p1"] and m0["rollout/async_admitted_groups"] == 4.0
        time.sleep(TRAINER_S)
        push_update(m, 5)  # admits p4, p5 at version 5
        second, m1 = m.get_async_groups(1, 5)
        time.sleep(TRAINER_S)
        after = m.groups.producer.counters()  # quiescent: the producer refilled up to the bound and waits
    finally:
        m.shutdown()
    assert [g[0].prompt for g in second] == ["p4", "p5"]
    assert (m1["rollout/stale_dropped"], m1["rollout/async_dropped/stale"], m1["rollout/async_dropped_groups"]) == (
        2.0,
        2.0,
        2.0,
    )
    assert m1["rollout/async_trained_groups"] == 4.0 and _counters_add_up(m1), m1
    # 4 at start, p4 p5 at version 5, p2 p3 again, p6 p7 once p4 p5 were taken; 4 trained, 4 waiting, 2 dropped
    kinds = ("admitted", "trained", "waiting", "running", "dropped")
    assert {k: after[f"rollout/async_{k}_groups"] for k in kinds} == {
        "admitted": 10.0,
        "trained": 4.0,
        "waiting": 4.0,
        "running": 0.0,
        "dropped": 2.0,
    }
    assert box["calls"] == ["p0", "p1", "p2", "p3", "p4", "p5", "p2", "p3", "p6", "p7"]  # p2, p3 generated again
    logged = [r.getMessage() for r in caplog.records if "not trained" in r.getMessage()]
    assert logged == [
        "group 2 (prompt 2) not trained: stale; its prompt goes back to the data buffer",
        "group 3 (prompt 3) not trained: stale; its prompt goes back to the data buffer",
    ]


def test_fully_async_batch_whose_samples_all_fail_ends_the_run(tiny_model_dir, tmp_path):
    """Every sample of the step's batch failed: RunFailedError with the first sample's own error (main: the step
    was skipped and the run went on); the groups are dropped as 'step_failed', their prompts back in the buffer."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path)
    fail = {"p0", "p1", "p2", "p3"}  # fail at once: the first four to finish
    m, _ = async_manager(tiny_model_dir, tmp_path, lambda box: sleeping_generate(box, fail_once=fail), overrides)
    m.start_async()
    try:
        with pytest.raises(RunFailedError) as err:
            m.get_async_groups(0, 0)
        assert m.groups.producer.dropped["step_failed"] == 4 and m.groups.producer.trained == 0
    finally:
        m.shutdown()
    assert str(err.value).startswith(
        "every sample of step 0 failed (4 of 4); first error: RuntimeError: engine error on p"
    )


def test_fully_async_one_failed_sample_in_16_is_a_flake(tiny_model_dir, tmp_path):
    """Batch 4 x 4 samples, one sample raises: the batch is handed to the step with 15 good samples."""
    _, overrides = async_run_args(tiny_model_dir, tmp_path, n_samples_per_prompt=4)
    m, _ = async_manager(tiny_model_dir, tmp_path, lambda box: sleeping_generate(box, fail_once={"p0"}), overrides)
    m.start_async()
    try:
        groups, metrics = m.get_async_groups(0, 0)
    finally:
        m.shutdown()
    assert len(groups) == 4 and metrics["rollout/num_samples"] == 16.0
    assert metrics["rollout/failed/generate_error"] == 1.0


def test_data_source_raising_inside_the_producer_ends_the_run(tiny_model_dir, tmp_path):
    """The data source raises when the producer asks for its 6th group: the producer stops (its thread ends, no
    request left running) and the next step raises RunFailedError carrying the original error."""
    _, overrides = async_run_args(
        tiny_model_dir, tmp_path, rollout_batch_size=2, max_staleness=1000, rollout_inflight_groups=4
    )
    m, _ = async_manager(tiny_model_dir, tmp_path, lambda box: sleeping_generate(box, fast_s=0.0), overrides)
    source = m.groups.data_source
    get = source.get_groups

    def failing_get(n):
        if source.next_group_index >= 5:
            raise ValueError(f"row {source.next_group_index} is unreadable")
        return get(n)

    source.get_groups = failing_get
    m.start_async()
    try:
        m.get_async_groups(0, 0)
        time.sleep(TRAINER_S)  # the producer refills: group 4 is admitted, group 5 raises
        with pytest.raises(RunFailedError) as err:
            m.get_async_groups(1, 0)
        m.groups.producer._thread.join(5)
        assert not m.groups.producer._thread.is_alive() and not m.groups.producer._tasks  # every request cancelled
    finally:
        m.shutdown()
    assert str(err.value) == "the fully-async rollout producer failed: ValueError: row 5 is unreadable"


@pytest.mark.parametrize("loop", ["sync", "one-step-off"])
def test_step_wise_loops_end_the_run_when_every_sample_fails(tiny_model_dir, tmp_path, loop):
    """sync and one-step-off generate each step with RolloutManager.generate: all samples failing raises
    RunFailedError with the first error; one failed sample in 16 completes the step; a data source that raises is
    a RunFailedError too."""

    def gen(box, bad):
        async def g(args, sample, sampling_params):
            if sample.prompt in bad and sample.index in bad[sample.prompt]:
                raise RuntimeError(f"reward service down for {sample.prompt}")
            sample.tokens = [1, 2]
            sample.append_response_tokens([5], trainable=True, log_probs=[-0.5], weight_version=0)
            sample.response = "x"
            sample.status = Status.COMPLETED
            return sample

        return g

    bad = {"p0": {1}, "p2": {0, 1, 2, 3}, "p3": {0, 1, 2, 3}}
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=gen({}, bad),
        num_prompts=4,
        loop=loop,
        use_tis=True,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
    )
    groups, metrics = m.generate(0)  # p0, p1: one sample of 16... of 8 fails
    assert metrics["rollout/failed/generate_error"] == 1.0 and metrics["rollout/num_samples"] == 8.0
    with pytest.raises(RunFailedError) as err:
        m.generate(1)  # p2, p3: all fail
    assert str(err.value).startswith(
        "every sample of step 1 failed (8 of 8); first error: RuntimeError: reward service down for p2"
    )

    def broken(n):
        raise OSError("prompt file vanished")

    m.groups.data_source.get_groups = broken
    with pytest.raises(RunFailedError, match=r"^the data source failed: OSError: prompt file vanished$"):
        m.generate(1)


def test_failed_summary_records_the_error_and_the_last_completed_step(tmp_path):
    """The summary covers the whole run (every invocation): its records in metrics.jsonl, evaluations apart."""
    records = [
        {"step": 0, "rollout/reward_mean": 0.5, "perf/step_time": 2.0},
        {"step": 1, "eval/arith/reward_mean": 0.25},
        {"step": 1, "rollout/reward_mean": 0.7, "perf/step_time": 4.0},
        {"step": 2, "rollout/reward_mean": 0.9, "perf/step_time": 6.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "rol')
    summary = failed_summary(tmp_path, 2, RunFailedError("every sample of step 3 failed"), resumed_at=[1])
    assert summary == {
        "output_dir": str(tmp_path),
        "status": "failed",
        "steps_run": 3,
        "resumed_at": [1, 2],
        "reward_first": 0.5,
        "reward_last": 0.9,
        "reward_mean": pytest.approx(0.7),
        "mean_step_seconds": 4.0,
        "eval_first": {"eval/arith/reward_mean": 0.25},
        "eval_last": {"eval/arith/reward_mean": 0.25},
        "error": "every sample of step 3 failed",
        "last_completed_step": 2,
        "failed_step": 3,
    }
    empty = tmp_path / "empty"
    assert failed_summary(empty, 0, ValueError("x"))["last_completed_step"] is None
    assert failed_summary(empty, 0, ValueError("x"))["error"] == "ValueError: x"
    json.dumps(summary)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--rollout-batch-size", "4", "--rollout-inflight-groups", "3"],
            "--rollout-inflight-groups 3 is below --rollout-batch-size 4: a fully-async step could never get its "
            "groups",
        ),
        (["--failure-exit-timeout", "0"], "--failure-exit-timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_bound_and_exit_timeout_flags_are_checked(tmp_path, flags, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "label": "x"}\n')
    with pytest.raises(ArgumentError) as err:
        parse_run_args(["--model", str(tmp_path), "--prompt-data", str(data), *flags])
    assert str(err.value) == message


def test_fully_async_step_waiting_for_groups_ends_when_every_engine_is_lost(tiny_model_dir, tmp_path):
    """The engines hang, then the health monitor declares them all lost: the step waiting for groups raises the
    monitor's EnginesLostError within about a second (main: it waited for groups up to an hour)."""
    import asyncio
    import threading

    from vime_core.engines.health import EnginesLostError

    async def hang(args, sample, sampling_params):
        await asyncio.sleep(3600)

    _, overrides = async_run_args(tiny_model_dir, tmp_path)
    m, _ = async_manager(tiny_model_dir, tmp_path, lambda box: hang, overrides)
    lost = threading.Event()

    def check_engines():
        if lost.is_set():
            raise EnginesLostError("every vLLM engine is gone and no restart is left")

    m.fleet.check_engines = check_engines  # what the health monitor answers (vime_core.engines.health)
    m.start_async()
    raised: list[BaseException] = []

    def step():
        try:
            m.get_async_groups(0, 0)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    waiter = threading.Thread(target=step, daemon=True)
    try:
        waiter.start()
        time.sleep(0.5)
        lost.set()
        t0 = time.monotonic()
        waiter.join(5)
        seconds = time.monotonic() - t0
    finally:
        m.shutdown()
    assert not waiter.is_alive() and seconds < 1.5, seconds
    assert [type(e) for e in raised] == [EnginesLostError]
