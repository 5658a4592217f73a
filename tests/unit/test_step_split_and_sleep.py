"""Where a colocated step's time goes and how the engines sleep (issue 40), on the CPU: the train step's split into
phases (``perf/train_*_time``), the profiled step, the host copy's overlap with a step, and the sleep/wake sequence of
colocated engines — level 2 and ``/wake_up?tags=weights`` then ``tags=kv_cache`` when the weight sync rewrites every
weight, level 1 and one wake otherwise — down to the HTTP requests the engine gets."""

from __future__ import annotations

import httpx
import pytest

from tests.support.samples import small_rl_batch
from vime_core.engines.engine import VLLMServer
from vime_core.engines.fleet import EngineFleet
from vime_core.testing.plugin_context import run_config
from vime_core.testing.trainer_args import trainer_config
from vime_core.trainer.profile import PROFILE_DIR_ENV, PROFILE_ENV, profile_path
from vime_core.trainer.torch_backend import TorchTrainer
from vime_core.weight_sync.disk import DiskWeightSync
from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync
from vime_core.weight_sync.host_copy import HostCopy
from vime_core.weight_sync.ipc import IpcWeightSync

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("gbs", [None, 2], ids=["one-minibatch", "two-minibatches"])
def test_the_train_step_is_split_into_phases_that_add_up(tiny_model_dir, gbs):
    trainer = TorchTrainer(trainer_config(global_batch_size=gbs, micro_batch_size=2), tiny_model_dir)
    m = trainer.train_step(small_rl_batch())
    phases = {k: v for k, v in m.items() if k.startswith("perf/train_") and k != "perf/train_compute_time"}
    expected = {"setup", "forward", "backward", "optimizer"} | ({"old_logprob"} if gbs else set())
    assert set(phases) == {f"perf/train_{p}_time" for p in expected}
    assert all(v >= 0 for v in phases.values())
    # the laps cover the step from the timer's start to its end: within the few lines before the first lap
    assert 0 <= m["perf/train_compute_time"] - sum(phases.values()) < 0.05 + 0.02 * m["perf/train_compute_time"]


def test_the_step_named_by_the_environment_is_profiled(tiny_model_dir, tmp_path, monkeypatch):
    trainer = TorchTrainer(trainer_config(micro_batch_size=4), tiny_model_dir)
    monkeypatch.setenv(PROFILE_ENV, "1")
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    trainer.train_step(small_rl_batch(step=0))
    assert not list(tmp_path.iterdir())
    trainer.train_step(small_rl_batch(step=1))
    table = (tmp_path / "profile_train_step_1_rank0.txt").read_text()
    assert table.startswith("train step of rollout step 1, sorted by self_cpu_time_total")
    assert "aten::mm" in table or "aten::addmm" in table
    monkeypatch.setenv(PROFILE_ENV, "two")
    with pytest.raises(ValueError, match=r"\$VIME_PROFILE_TRAIN_STEP='two': expected the 0-based index"):
        profile_path(1, trainer)


def test_host_copy_overlap_with_a_step_is_the_shared_interval(tmp_path):
    copy = HostCopy(tmp_path)
    assert copy.overlap(0.0, 5.0) == 0.0  # no copy yet
    copy.started_at, copy.finished_at = 10.0, 13.0
    assert copy.overlap(11.0, 20.0) == 2.0  # the copy ran 11-13 of the step
    assert copy.overlap(14.0, 20.0) == 0.0  # finished before the step
    assert copy.overlap(8.0, 12.5) == 2.5
    copy.finished_at = None  # still running: up to the step's end
    assert copy.overlap(11.0, 12.0) == 1.0


class _Engine:
    """Records the sleep/wake calls the fleet makes (the calls themselves are checked against HTTP below)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def sleep(self, level: int) -> None:
        self.log.append((self.name, "sleep", level))

    def wake_up(self, tags=None) -> None:
        self.log.append((self.name, "wake_up", tags))


def _fleet(strategy, lora: bool = False) -> tuple[EngineFleet, list]:
    fleet = EngineFleet.__new__(EngineFleet)  # only the engines, the strategy and the adapters matter here
    log: list = []
    fleet.engines = [_Engine("e0", log), _Engine("e1", log)]
    fleet.weight_sync = strategy
    fleet.adapters = object() if lora else None
    return fleet, log


def test_a_weight_sync_that_rewrites_every_weight_sleeps_at_level_2_and_wakes_weights_then_kv_cache(tmp_path):
    for strategy in (IpcWeightSync(run_config()), DiskWeightSync(run_config(update_weight_disk_dir=tmp_path))):
        fleet, log = _fleet(strategy)
        assert fleet.sleep_engines() == {"perf/sleep_level": 2.0}
        wake = fleet.wake_engines()
        assert log == [
            ("e0", "sleep", 2),
            ("e1", "sleep", 2),
            ("e0", "wake_up", ["weights"]),
            ("e1", "wake_up", ["weights"]),
            ("e0", "wake_up", ["kv_cache"]),
            ("e1", "wake_up", ["kv_cache"]),
        ], strategy.NAME
        assert set(wake) == {"perf/wake_weights_time", "perf/wake_kv_cache_time"}


def test_a_delta_or_a_lora_adapter_keeps_the_weights_asleep_at_level_1():
    delta = DiskDeltaWeightSync.__new__(DiskDeltaWeightSync)  # applies a delta on the engine's own weights
    assert DiskDeltaWeightSync.RELOADS_ALL_WEIGHTS is False
    for strategy, lora in ((delta, False), (IpcWeightSync(run_config()), True)):
        fleet, log = _fleet(strategy, lora)
        assert fleet.sleep_engines() == {"perf/sleep_level": 1.0}
        assert fleet.wake_engines() == {}
        assert log == [("e0", "sleep", 1), ("e1", "sleep", 1), ("e0", "wake_up", None), ("e1", "wake_up", None)]


def test_the_engine_gets_vllms_sleep_and_wake_requests():
    """What :class:`VLLMServer` sends: ``/sleep?level=2``, ``/wake_up?tags=weights`` (vLLM reads the repeated
    ``tags`` parameter with ``getlist``), and a bare ``/wake_up`` for everything."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        return httpx.Response(200)

    server = VLLMServer("/nonexistent/model", port=1)
    server._http = httpx.Client(base_url=server.url, transport=httpx.MockTransport(handler))
    server.sleep(2)
    server.wake_up(["weights"])
    server.wake_up(["kv_cache"])
    server.wake_up()
    server.wake_up(["weights", "kv_cache"])
    assert seen == [
        "POST /sleep?level=2",
        "POST /wake_up?tags=weights",
        "POST /wake_up?tags=kv_cache",
        "POST /wake_up?",
        "POST /wake_up?tags=weights&tags=kv_cache",
    ]
