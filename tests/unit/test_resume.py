"""A run killed after a checkpoint and resumed trains every prompt of the epoch exactly once, in every loop mode.

The rollout manager, its data buffer, the async producer and the loop's group source
(``vime_core.run.step_source.GroupSource``) are the real ones, in-process; the engines are replaced by a generate
function that sleeps (as in ``test_async_admission``), and a step's "training" is the weight-version bump the loop
makes after it. A kill is simulated by dropping the manager and the source right after the checkpoint's data state was
taken (what ``vime_core.run.checkpoint_schedule.save_checkpoint`` writes), or one step later (a kill mid-step 4: that
step's work is lost and its records are rolled back, :func:`vime_core.run.checkpoint_schedule.roll_back_records`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.support.async_rollout import async_run_args, push_update, sleeping_generate
from tests.support.engine_stand_ins import FAST, Engine, Router, disk_recovery
from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.engines.health import EngineMonitor, EnginesLostError
from vime_core.run.checkpoint import checkpoint_root, commit_checkpoint, latest_checkpoint, new_checkpoint_dir
from vime_core.run.checkpoint_schedule import TRAINED_PROMPTS_FILE, roll_back_records, should_save
from vime_core.run.failed_step import stop_engines_lost as _stop_engines_lost
from vime_core.run.state import RunState
from vime_core.run.step_source import GroupSource as _GroupSource

pytestmark = pytest.mark.unit

NUM_PROMPTS = 12
BATCH = 2
STEPS = NUM_PROMPTS // BATCH  # one epoch


class _InProcessHandle:
    """``handle.method.remote(*a)`` runs ``manager.method(*a)`` at once and returns its result as the "ref" (the
    order of calls is that of a Ray actor's: one-step-off's next generate runs before this step's update)."""

    def __init__(self, manager):
        self.manager = manager

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.manager, name))


def _start(tiny_model_dir, tmp_path, loop, state=None, version=0, generate=sleeping_generate):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args, overrides = async_run_args(tiny_model_dir, tmp_path, loop=loop, rollout_batch_size=BATCH, num_rollout=STEPS)
    box: dict = {}
    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=generate(box), num_prompts=NUM_PROMPTS, **overrides)
    box["m"] = m
    if state is not None:
        m.load_data_state(json.loads(json.dumps(state)))  # through JSON, as data_source.json
    if version:
        push_update(m, version)  # the loop pushes the checkpoint's weights before starting
    if loop == "fully-async":
        m.start_async()
    rollout = _InProcessHandle(m) if loop == "one-step-off" else m
    return m, _GroupSource(args, rollout, wait=lambda ref: ref), box


def _steps(m, source, first, last, version, trained):
    """Steps ``first .. last - 1`` as the loop runs them; appends each step's prompt indexes to ``trained``."""
    for step in range(first, last):
        groups, _ = source.get(step, version)
        assert len(groups) == BATCH
        trained.append(source.last_taken["prompt_index"])
        version += 1
        push_update(m, version)
    return version


def _run(tiny_model_dir, tmp_path, loop, kill_after=None, lose_one_step=False):
    """The prompt indexes each step trained, over one epoch; with ``kill_after=c``: checkpoint after step ``c``,
    (``lose_one_step``: run one more step), kill, resume from the checkpoint and finish the epoch."""
    m, source, box = _start(tiny_model_dir, tmp_path / "a", loop)
    trained: list[list[int]] = []
    try:
        version = _steps(m, source, 0, kill_after or STEPS, 0, trained)
        if kill_after is None:
            return trained, box
        state = m.data_state(source.unconsumed())
        if lose_one_step:  # trained, then killed before the next checkpoint: its work is lost
            _steps(m, source, kill_after, kill_after + 1, version, [])
    finally:
        m.shutdown()
    m, source, box2 = _start(tiny_model_dir, tmp_path / "b", loop, state, version)
    try:
        _steps(m, source, kill_after, STEPS, version, trained)
    finally:
        m.shutdown()
    box["calls"] += box2.get("calls", [])
    return trained, box


@pytest.mark.parametrize("loop", ["sync", "one-step-off", "fully-async"])
@pytest.mark.parametrize("lose_one_step", [False, True], ids=["kill-after-checkpoint", "kill-mid-next-step"])
def test_resume_trains_every_prompt_once(tiny_model_dir, tmp_path, loop, lose_one_step):
    reference, _ = _run(tiny_model_dir, tmp_path / "ref", loop)
    assert sorted(p for step in reference for p in step) == list(range(NUM_PROMPTS))
    resumed, box = _run(tiny_model_dir, tmp_path / "kill", loop, kill_after=3, lose_one_step=lose_one_step)
    flat = [p for step in resumed for p in step]
    assert sorted(flat) == list(range(NUM_PROMPTS)), resumed  # no repeat, no skip
    if loop != "fully-async":  # the same prompts in the same steps as without the kill
        assert resumed == reference
    else:  # the groups in flight at the checkpoint are generated again after the resume, in admission order
        assert [p for step in resumed[:3] for p in step] == [p for step in reference[:3] for p in step]
    if loop != "fully-async":
        # one-step-off: step 3's groups, generated before the kill, were saved with the checkpoint and are not
        # generated again; only a step whose work the kill lost is generated twice
        assert len(box["calls"]) == NUM_PROMPTS + (BATCH if lose_one_step else 0)


def test_one_step_off_checkpoint_holds_the_prefetched_groups_as_generated(tiny_model_dir, tmp_path):
    """The next step's groups were generated while this step trained: the checkpoint keeps them (tokens, log-probs,
    weight versions) first in line, and counts their prompts as taken from the data."""
    m, source, _ = _start(tiny_model_dir, tmp_path, "one-step-off")
    try:
        _steps(m, source, 0, 3, 0, [])
        state = m.data_state(source.unconsumed())
    finally:
        m.shutdown()
    assert (state["offset"], state["next_group_index"]) == (8, 8)
    returned = state["returned"]
    assert [[s["prompt_index"] for s in g] for g in returned] == [[6], [7]]
    assert [g[0]["status"] for g in returned] == ["completed", "completed"]
    assert [g[0]["weight_versions"] for g in returned] == [[2, 2], [2, 2]]  # generated during step 2's training


def test_fully_async_checkpoint_returns_groups_in_flight_in_admission_order(tiny_model_dir, tmp_path):
    m, source, _ = _start(tiny_model_dir, tmp_path, "fully-async")
    try:
        _steps(m, source, 0, 3, 0, [])
        state = m.data_state([])
    finally:
        m.shutdown()
    # (1 + max-staleness 1) x 2 groups at version 0, 2 more per update: 10 admitted, 6 trained, 4 returned as prompts
    assert (state["offset"], state["next_group_index"]) == (10, 10)
    returned = state["returned"]
    assert [g[0]["prompt_index"] for g in returned] == [6, 7, 8, 9]
    assert all(s["status"] == "pending" and s["tokens"] == [] for g in returned for s in g)


def _dying_generate(box):
    """``sleeping_generate`` until ``box["die"] = (engine, monitor)``: from then on the engine's process is gone,
    the monitor's check finds it, and every request fails with a connection error (what vllm-router answers)."""
    inner = sleeping_generate(box)

    async def gen(args, sample, sampling_params):
        if "die" not in box:
            return await inner(args, sample, sampling_params)
        engine, monitor = box["die"]
        engine.alive = False
        monitor.check_once()
        raise httpx.ConnectError("connection refused")

    return gen


class _Trainer:
    """Stands in for the trainer group: "training" is the loop's weight-version bump here, so its checkpoint is a
    marker file."""

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "marker").write_text("trained")


def test_engines_lost_mid_rollout_the_resume_trains_the_failed_steps_prompts_once(tiny_model_dir, tmp_path):
    """Step 3's engine dies mid-rollout with no restart left: the manager puts the step's two prompts back into the
    buffer, the loop's stop path checkpoints 3 finished steps with them, and the resumed run trains prompts 6..11 —
    over the two runs every prompt exactly once, in the uninterrupted order."""
    out = tmp_path / "a" / "out"
    m, source, box = _start(tiny_model_dir, tmp_path / "a", "sync", generate=_dying_generate)
    trained: list[list[int]] = []
    engine = Engine("http://127.0.0.1:9", tmp_path / "e0.log")
    recovery, _ = disk_recovery(tmp_path)
    monitor = EngineMonitor([engine], Router([engine.url]), recovery, dataclasses.replace(FAST, max_restarts=0))
    try:
        version = _steps(m, source, 0, 3, 0, trained)
        m.fleet.monitor = m.runner.monitor = monitor
        box["die"] = (engine, monitor)
        with pytest.raises(EnginesLostError) as lost:
            source.get(3, version)
        log = SimpleNamespace(keep_checkpoints=0)
        run = RunState(None, None, log, out, _Trainer(), m, source, step=3, version=version)
        error = _stop_engines_lost(run, lost.value)
    finally:
        m.shutdown()
    ckpt = checkpoint_root(out) / "step_000003"
    assert str(error) == (
        "every vLLM engine is gone and no restart is left:\n"
        f"engine 0 (http://127.0.0.1:9): exited with code -9, restarted 0 time(s); log: {tmp_path / 'e0.log'}\n"
        f"checkpoint of 3 finished step(s) saved: {ckpt}"
    )
    assert latest_checkpoint(out) == ckpt
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 3, "weight_version": 3}
    state = json.loads((ckpt / "data_source.json").read_text())
    assert (state["epoch"], state["offset"], state["next_group_index"], state["returned"]) == (0, 6, 6, [])
    m, source, _ = _start(tiny_model_dir, tmp_path / "b", "sync", state, version)
    try:
        _steps(m, source, 3, STEPS, version, trained)
    finally:
        m.shutdown()
    assert trained == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_engines_lost_in_the_weight_update_after_training_count_the_step_as_finished(tiny_model_dir, tmp_path):
    """Step 3 trained (weights pushed as version 4) but the weight update found no engine: the checkpoint counts 4
    finished steps at version 4 and records step 3's prompts; the resume trains 8..11, so each prompt once."""
    out = tmp_path / "a" / "out"
    out.mkdir(parents=True)
    m, source, _ = _start(tiny_model_dir, tmp_path / "a", "sync")
    trained: list[list[int]] = []
    try:
        version = _steps(m, source, 0, 3, 0, trained)
        source.get(3, version)  # generated; trained as version 4 (trained_version below)
        trained.append(source.last_taken["prompt_index"])
        lost = EnginesLostError("every vLLM engine is gone and no restart is left:\nengine 0 (u): exited with code -9")
        log = SimpleNamespace(keep_checkpoints=0)
        run = RunState(None, None, log, out, _Trainer(), m, source, step=3, version=version)
        error = _stop_engines_lost(run, lost, trained_version=version + 1)
    finally:
        m.shutdown()
    ckpt = checkpoint_root(out) / "step_000004"
    assert str(error).splitlines()[-1] == f"checkpoint of 4 finished step(s) saved: {ckpt}"
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 4, "weight_version": 4}
    records = [json.loads(x) for x in (out / TRAINED_PROMPTS_FILE).read_text().splitlines()]
    assert records == [{"step": 3, "prompt_index": [6, 7], "group_index": [6, 7]}]
    state = json.loads((ckpt / "data_source.json").read_text())
    assert (state["offset"], state["returned"]) == (8, [])
    m, source, _ = _start(tiny_model_dir, tmp_path / "b", "sync", state, 4)
    try:
        _steps(m, source, 4, STEPS, 4, trained)
    finally:
        m.shutdown()
    assert trained == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_roll_back_records_drops_the_steps_after_the_checkpoint(tmp_path):
    lines = [
        {"step": 0, "eval/a/score": 0.1},
        {"step": 0, "rollout/reward_mean": 1.0},
        {"step": 1, "rollout/reward_mean": 2.0},
        {"step": 2, "eval/a/score": 0.2},  # evaluated after 2 steps: kept when resuming from step 2
        {"step": 2, "rollout/reward_mean": 3.0},  # step index 2 = the third step, trained again
        {"step": 3, "eval/a/score": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "rol')
    (tmp_path / TRAINED_PROMPTS_FILE).write_text(
        "".join(json.dumps({"step": s, "prompt_index": [s]}) + "\n" for s in range(3))
    )
    roll_back_records(tmp_path, 2)
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]
    prompts = [json.loads(x) for x in (tmp_path / TRAINED_PROMPTS_FILE).read_text().splitlines()]
    assert prompts == [{"step": 0, "prompt_index": [0]}, {"step": 1, "prompt_index": [1]}]


@pytest.mark.parametrize(
    ("steps_done", "elapsed_s", "expected"),
    [(1, 0.0, False), (3, 0.0, True), (4, 59.0, False), (4, 60.0, True), (10, 0.0, True)],
)
def test_should_save_by_steps_minutes_and_at_the_end(steps_done, elapsed_s, expected):
    args = SimpleNamespace(num_rollout=10, save_interval=3, save_interval_minutes=1.0)
    assert should_save(args, steps_done, elapsed_s) is expected


def _checkpoint(out, step, max_checkpoints=None):
    tmp = new_checkpoint_dir(out, step)
    (tmp / "trainer").mkdir()
    (tmp / "trainer" / "model.safetensors").write_bytes(b"w%d" % step)
    return commit_checkpoint(tmp, {"step": step, "weight_version": step}, {"offset": step}, max_checkpoints)


def test_a_torn_checkpoint_is_never_picked(tmp_path):
    """A kill mid-save leaves ``step_N.tmp`` (or, copied by hand, a ``step_N`` without ``meta.json``) and maybe a
    ``latest`` naming it: the resume takes the newest complete checkpoint, and the next save deletes the debris."""
    assert latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 2)
    good = _checkpoint(tmp_path, 3)
    root = checkpoint_root(tmp_path)
    torn = new_checkpoint_dir(tmp_path, 4)  # killed while the trainer was writing
    (torn / "trainer").mkdir()
    (torn / "meta.json").write_text('{"step": 4, "weight_version": 4}')  # even with its meta written
    (root / "step_000005").mkdir()  # a final name without meta.json
    (root / "step_000005" / "data_source.json").write_text("{")
    (root / "latest").write_text("step_000005")
    assert latest_checkpoint(tmp_path) == good
    assert json.loads((good / "meta.json").read_text()) == {"step": 3, "weight_version": 3}
    assert json.loads((good / "data_source.json").read_text()) == {"offset": 3}
    _checkpoint(tmp_path, 4)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003", "step_000004"]
    assert (root / "latest").read_text() == "step_000004" and latest_checkpoint(tmp_path) == root / "step_000004"


def test_max_checkpoints_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        _checkpoint(tmp_path, step, max_checkpoints=2)
        names = sorted(p.name for p in checkpoint_root(tmp_path).iterdir() if p.name != "latest")
        assert names == [f"step_{s:06d}" for s in range(max(1, step - 1), step + 1)]
    assert (latest_checkpoint(tmp_path) / "trainer" / "model.safetensors").read_bytes() == b"w5"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--keep-checkpoints", "-1", "--keep-checkpoints must be >= 0, got -1"),
        ("--max-checkpoints", "-2", "--keep-checkpoints must be >= 0, got -2"),
        ("--save-interval", "0", "--save-interval must be >= 1, got 0"),
        ("--save-interval-minutes", "0", "--save-interval-minutes must be > 0 minutes, got 0.0"),
    ],
)
def test_checkpoint_flags_are_checked(tmp_path, flag, value, message):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "p"}\n')
    with pytest.raises(ArgumentError, match=message):
        parse_run_args(["--model", "m", "--prompt-data", str(data), flag, value])
