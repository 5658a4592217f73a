"""The trainer rank's garbage collector (vime_core/trainer/gc_control.py): exact counts of what :class:`GcClock`
sees, the frozen start-up heap left out of later collections, Megatron-LM's ``--manual-gc`` schedule, its flags'
checks, and a real train step's metrics through :class:`TrainerWorker`."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.support.samples import small_rl_batch
from vime_core.cli.arguments import parse_run_args
from vime_core.cli.checks import check_run_args
from vime_core.config import RunConfig
from vime_core.config.errors import ArgumentError
from vime_core.plugins.manager import get_plugins
from vime_core.run.preflight import trainer_classes
from vime_core.trainer.gc_control import GcClock, ManualGc, freeze_heap
from vime_core.trainer.group import TrainerWorker

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


@pytest.fixture
def restore_gc():
    yield
    gc.enable()
    gc.unfreeze()


def test_the_clock_counts_each_collection_and_its_generation(restore_gc):
    clock = GcClock().start()
    gc.disable()  # no automatic collection between the explicit ones
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    metrics = clock.stop()
    assert clock._callback not in gc.callbacks
    assert metrics["perf/train_gc_collections"] == 3.0 and metrics["perf/train_gc_full_collections"] == 1.0
    assert metrics["perf/train_gc_time"] > 0.0
    gc.collect()  # after stop: not counted
    assert clock.collections == 3
    assert clock.start().stop() == {
        "perf/train_gc_time": 0.0,
        "perf/train_gc_collections": 0.0,
        "perf/train_gc_full_collections": 0.0,
    }


def test_a_frozen_cycle_survives_collections_and_a_later_one_does_not(restore_gc):
    before = _Node()
    before_ref = weakref.ref(before)
    del before
    gc.disable()
    frozen = freeze_heap()  # collects first: the cycle made before is freed, not frozen
    assert before_ref() is None
    assert frozen > 0
    kept = _Node()
    gc.freeze()
    kept_ref = weakref.ref(kept)
    del kept
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None  # created after the freeze: collected
    assert kept_ref() is not None  # frozen: never walked, so never freed


def test_manual_gc_turns_automatic_collection_off_and_collects_every_interval(restore_gc):
    manual = ManualGc(2)
    assert not gc.isenabled()
    clock = GcClock().start()
    done = [manual.after_step() for _ in range(5)]
    metrics = clock.stop()
    assert done == [False, True, False, True, False]
    assert metrics["perf/train_gc_full_collections"] == 2.0 and metrics["perf/train_gc_collections"] == 2.0
    never = ManualGc(0)
    assert [never.after_step() for _ in range(3)] == [False, False, False]
    with pytest.raises(ValueError, match=r"^--manual-gc-interval must be >= 0 \(train steps between collections\), "):
        ManualGc(-1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
        (["--manual-gc-interval", "5"], "--manual-gc-interval 5 takes effect only with --manual-gc"),
    ],
)
def test_the_flags_are_checked_before_anything_starts(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(ArgumentError, match=message):
        check_run_args(_args(tiny_model_dir, tmp_path, flags))


def _args(model, tmp_path, flags):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "p", "label": "x"}\n')
    argv = ["--model", str(model), "--prompt-data", str(data), "--output-dir", str(tmp_path / "out")]
    return parse_run_args([*argv, "--train-dtype", "float32", "--micro-batch-size", "4", *flags])


def test_a_train_step_reports_its_collections_and_manual_gc_collects_once(tiny_model_dir, tmp_path, restore_gc):
    """The torch trainer's real step on the tiny model, in a TrainerWorker with --manual-gc --manual-gc-interval 1:
    automatic collection is off, so the step's one collection is the manual one after it."""
    cfg = RunConfig.from_args(_args(tiny_model_dir, tmp_path, ["--manual-gc", "--manual-gc-interval", "1"]))
    worker = TrainerWorker(cfg, tiny_model_dir, trainer_classes(get_plugins(), cfg))
    assert worker.frozen_objects > 100_000 and not gc.isenabled()  # torch, transformers, the model: all frozen
    metrics = worker.train_step(small_rl_batch())
    assert metrics["perf/train_gc_collections"] == 1.0 and metrics["perf/train_gc_full_collections"] == 1.0
    assert 0.0 < metrics["perf/train_gc_time"] < metrics["perf/train_worker_time"]
    assert worker.manual_gc.steps == 1
    assert ("perf/train_cuda_mallocs" in metrics) == torch.cuda.is_available()  # the allocator's count: CUDA only
