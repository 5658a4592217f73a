"""The engine health monitor's bookkeeping (:mod:`vime_core.engines.health`) and the weight recovery of a replacement
(:mod:`vime_core.engines.weight_recovery`), with exact states, counters, texts and tensors.

The engines and the router here are stand-ins that record calls (their ``/health`` is a real HTTP server on
127.0.0.1); the real vLLM engines and vllm-router meet the monitor in ``tests/integration/test_fault_injection.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.engine_stand_ins import FAST, Engine, Router, disk_recovery
from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig
from vime_core.engines.health import (
    EngineMonitor,
    EnginesLostError,
    engines_lost,
    generate_with_retries,
)
from vime_core.engines.weight_recovery import WeightRecovery
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample
from vime_core.weight_sync.disk import DiskWeightSync
from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync

pytestmark = pytest.mark.unit


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a) -> None:
        pass


@pytest.fixture(scope="module")
def health_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_dead_engine_is_removed_replaced_at_the_current_version_and_re_added(tmp_path, health_url):
    recovery, ws = disk_recovery(tmp_path)
    update = ws.push([("w", torch.ones(2))], 3)
    assert recovery.applied(update) == []  # kept for recoveries
    engines = [Engine(health_url, tmp_path / "e0.log"), Engine(health_url, tmp_path / "e1.log")]
    router = Router([health_url, health_url])
    # a backoff long enough that the replacement cannot be up before the state is read (the test machine is busy)
    monitor = EngineMonitor(engines, router, recovery, dataclasses.replace(FAST, backoff_s=1.0), log_dir=tmp_path)
    engines[1].alive = False
    monitor.check_once()
    assert [s.state for s in monitor.slots] == ["up", "down"]
    assert monitor.serving() == [engines[0]]
    _wait(lambda: monitor.slots[1].state == "up", timeout_s=15.0)
    path = str(Path(update.payload["path"]).resolve())
    assert engines[1].calls == [
        ("restart",),
        ("vime_load_weights", path, 3),
        ("reset_prefix_cache",),
        ("set_weight_version", 3),
    ]
    assert router.calls == [("remove", health_url), ("add", health_url)]
    m = monitor.take_metrics()
    assert {k: v for k, v in m.items() if k != "rollout/engine_recovery_seconds"} == {
        "rollout/engine_restarts": 1.0,
        "rollout/router_restarts": 0.0,
        "rollout/requests_retried": 0.0,
        "rollout/engines_down": 0.0,
    }
    assert m["rollout/engine_recovery_seconds"] > 0
    assert monitor.take_metrics()["rollout/engine_restarts"] == 0.0  # per step
    events = [json.loads(line) for line in (tmp_path / "health_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["engine_down", "engine_up"]
    assert events[0]["reason"] == "exited with code -9" and events[1]["weight_version"] == 3
    monitor.stop()


def test_restarts_spent_on_every_engine_stop_the_run_with_urls_exit_codes_and_logs(tmp_path, health_url):
    recovery, _ = disk_recovery(tmp_path)
    engine = Engine(health_url, tmp_path / "e0.log", fail_restarts=5)
    monitor = EngineMonitor([engine], Router([health_url]), recovery, FAST, log_dir=tmp_path)
    engine.alive = False
    monitor.check_once()
    _wait(lambda: monitor.fatal is not None)
    assert monitor.slots[0].state == "lost" and monitor.slots[0].restarts == 2
    assert monitor.fatal == (
        "every vLLM engine is gone and no restart is left:\n"
        f"engine 0 ({health_url}): restart 2 failed: no memory left, restarted 2 time(s); log: {tmp_path / 'e0.log'}"
    )
    with pytest.raises(EnginesLostError) as err:
        monitor.raise_if_lost()
    assert engines_lost(err.value)
    monitor.stop()


def test_hung_engine_is_taken_down_after_the_hang_timeout(tmp_path):
    recovery, _ = disk_recovery(tmp_path)
    engine = Engine("http://127.0.0.1:9", tmp_path / "e0.log")  # nothing listens: /health fails, process runs
    monitor = EngineMonitor([engine], Router([engine.url]), recovery, FAST)
    monitor.check_once()
    assert monitor.slots[0].state == "up"  # failing, not yet for 0.3 s
    time.sleep(0.35)
    monitor.slots[0].restarts = FAST.max_restarts  # keep it down to read its reason
    monitor.check_once()
    _wait(lambda: monitor.slots[0].state == "lost")
    assert re.fullmatch(r"hung: GET /health failing for \d+ s", monitor.slots[0].last_exit), monitor.slots[0].last_exit
    monitor.stop()


def test_dead_router_restarts_with_the_engines_that_are_up(tmp_path, health_url):
    recovery, _ = disk_recovery(tmp_path)
    engines = [Engine(health_url, tmp_path / "e0.log"), Engine("http://127.0.0.1:9", tmp_path / "e1.log")]
    router = Router([e.url for e in engines])
    monitor = EngineMonitor(engines, router, recovery, FAST)
    monitor.slots[1].state = "down"
    router.alive = False
    monitor.check_once()
    assert router.calls == [("stop",), ("start", (health_url,))]
    assert monitor.take_metrics()["rollout/router_restarts"] == 1.0
    monitor.stop()


def test_weight_sync_skips_an_engine_that_died_during_it_and_raises_for_a_living_one(tmp_path, health_url):
    recovery, ws = disk_recovery(tmp_path)
    engines = [Engine(health_url, tmp_path / "e0.log"), Engine(health_url, tmp_path / "e1.log")]
    monitor = EngineMonitor(engines, Router([health_url] * 2), recovery, FAST)
    monitor.slots[1].restarts = FAST.max_restarts  # no replacement: keep the bookkeeping simple

    class Dies(DiskWeightSync):
        def apply(self, engine, update, timeout_s):
            if engine is engines[1]:
                engine.alive = False
                raise httpx.ConnectError("connection refused")
            engine.calls.append(("apply", update.version))

    dies = Dies(ws.run_config)
    metrics, cleanup = monitor.sync_weights(dies, ws.push([("w", torch.ones(2))], 1), "wait", 5.0)
    assert metrics["weight_sync/engines_synced"] == 1.0 and cleanup == []
    phases = ("pause", "load", "label", "resume")
    assert sorted(metrics) == sorted(["weight_sync/engines_synced", *(f"weight_sync/{p}_seconds" for p in phases)])
    assert all(metrics[f"weight_sync/{p}_seconds"] >= 0 for p in phases)
    assert engines[0].calls == [
        ("pause", "wait"),
        ("apply", 1),
        ("reset_prefix_cache",),
        ("set_weight_version", 1),
        ("resume",),
    ]
    assert engines[1].calls == [("pause", "wait")]  # died in the update: not resumed, not labelled
    _wait(lambda: monitor.slots[1].state == "lost")
    assert monitor.slots[0].state == "up" and monitor.fatal is None
    assert recovery.version == 1

    class Refuses(DiskWeightSync):
        def apply(self, engine, update, timeout_s):
            raise RuntimeError("checksum mismatch")

    with pytest.raises(RuntimeError, match="checksum mismatch"):  # engine 0 answers /health: a real error
        monitor.sync_weights(Refuses(ws.run_config), ws.push([("w", torch.zeros(2))], 2), "wait", 5.0)
    assert monitor.slots[0].state == "up"
    monitor.stop()


def test_a_retried_sample_keeps_nothing_of_the_failed_attempt(tmp_path, health_url):
    recovery, _ = disk_recovery(tmp_path)
    monitor = EngineMonitor([Engine(health_url, tmp_path / "e0.log")], Router([health_url]), recovery, FAST)
    monitor.start()
    attempts = []

    async def generate(args, sample, params):
        attempts.append(list(sample.tokens))
        if len(attempts) == 1:
            sample.append_response_tokens([7, 8], trainable=True, log_probs=[-0.5, -0.25], weight_version=0)
            raise httpx.ReadError("peer closed connection")
        sample.append_response_tokens([9], trainable=True, log_probs=[-0.125], weight_version=1)
        return sample

    sample = Sample(prompt="p", tokens=[1, 2])
    out = asyncio.run(generate_with_retries(monitor, generate, plugin_context(), sample, {}))
    assert attempts == [[1, 2], [1, 2]]
    assert out.tokens == [1, 2, 9] and out.rollout_log_probs == [-0.125] and out.weight_versions == [1]
    assert monitor.take_metrics()["rollout/requests_retried"] == 1.0

    async def broken(args, sample, params):
        raise ValueError("malformed row")

    with pytest.raises(ValueError, match="malformed row"):  # not an engine failure: no retry
        asyncio.run(generate_with_retries(monitor, broken, plugin_context(), Sample(prompt="p"), {}))
    assert monitor.take_metrics()["rollout/requests_retried"] == 0.0
    monitor.stop()


def test_disk_delta_recovery_writes_the_current_version_in_full(tmp_path):
    base = tmp_path / "model"
    base.mkdir()
    w0 = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(w0, str(base / "model.safetensors"))
    args = default_args(
        update_weight_disk_dir=tmp_path / "weights", keep_weight_updates=False, update_weight_delta_base=str(base)
    )
    trainer, rollout = DiskDeltaWeightSync(RunConfig.from_args(args)), DiskDeltaWeightSync(RunConfig.from_args(args))
    recovery = WeightRecovery(rollout, args.update_weight_disk_dir)
    assert recovery.full_weights() is None  # version 0: the model directory itself
    w1 = {"a": w0["a"] + 0.5, "b": w0["b"]}
    w2 = {"a": w1["a"], "b": w0["b"] * 3}
    for version, w in ((1, w1), (2, w2)):
        update = trainer.push(w.items(), version)
        assert recovery.applied(update) == [update]  # deltas are removed as before
        rollout.cleanup(update)
    path = Path(recovery.full_weights())
    assert path.name == "recovery_v000002"
    got = load_file(str(path / "model.safetensors"))
    assert set(got) == {"a", "b"}
    assert torch.equal(got["a"], w2["a"]) and torch.equal(got["b"], w2["b"]) and got["b"].dtype == torch.bfloat16


def test_other_strategies_cannot_recover_past_version_zero():
    class Nccl(DiskWeightSync):
        NAME = "nccl"

    recovery = WeightRecovery(Nccl(default_args()), None)
    assert recovery.supported
    recovery.version = 4
    assert not recovery.supported
    with pytest.raises(RuntimeError, match=r"--weight-sync nccl: no host-side copy of weight version 4"):
        recovery.full_weights()


def test_engines_lost_is_recognised_through_a_ray_actor_error():
    from ray.exceptions import RayTaskError

    lost = EnginesLostError("every vLLM engine is gone")
    assert engines_lost(RayTaskError("generate", "traceback", lost).as_instanceof_cause())
    assert engines_lost(RayTaskError("generate", "traceback", lost))
    assert not engines_lost(RayTaskError("generate", "traceback", RuntimeError("other")))


def test_a_disk_update_without_a_path_is_refused_when_applied_and_shutdown_never_raises(tmp_path, tiny_model_dir):
    """Issue 27: a kept update without a path made RolloutManager.shutdown() raise KeyError 'path' at the end."""
    from tests.support.rollout import manager_with_hooks
    from vime_core.weight_sync.base import WeightUpdate

    recovery, _ = disk_recovery(tmp_path)
    with pytest.raises(ValueError) as e:
        recovery.applied(WeightUpdate(3, {"dir": "x"}))
    assert str(e.value) == "--weight-sync disk: weight update 3 has no 'path' in its payload"

    class Raising:
        def stop(self):
            pass

        class recovery:  # noqa: N801 - stands in for WeightRecovery.close failing
            @staticmethod
            def close():
                raise KeyError("path")

    manager = manager_with_hooks(tiny_model_dir, tmp_path)
    manager.fleet.monitor = Raising()
    manager.shutdown()  # logs, does not raise


def test_a_weight_update_is_bounded_by_its_timeout_while_a_replacement_loads_or_an_engine_hangs(tmp_path, health_url):
    """--weight-sync-timeout bounds the whole update: waiting for the monitor's lock (a replacement loading holds it)
    and every engine call, not only the strategy's transfer (a paused engine that never answers, but whose /health
    does, is a real error raised within the timeout)."""
    recovery, ws = disk_recovery(tmp_path)
    engine = Engine(health_url, tmp_path / "e0.log")
    monitor = EngineMonitor([engine], Router([health_url]), recovery, FAST)
    held, release = threading.Event(), threading.Event()

    def replacement_loading() -> None:
        with monitor.lock:
            held.set()
            release.wait(30)

    threading.Thread(target=replacement_loading, daemon=True).start()
    held.wait(5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        monitor.sync_weights(ws, ws.push([("w", torch.ones(2))], 1), "wait", 0.5)
    assert time.monotonic() - t0 < 3.0
    assert str(e.value) == (
        "weight update 1: the engines were not free for it within --weight-sync-timeout 0.5 s "
        "(a replacement engine was being loaded)"
    )
    assert engine.calls == [] and recovery.version == 0
    release.set()

    hang = threading.Event()
    engine.pause = lambda mode: hang.wait(30)  # the engine takes the request and never answers
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        monitor.sync_weights(ws, ws.push([("w", torch.ones(2))], 2), "wait", 0.5)
    assert time.monotonic() - t0 < 3.0  # the timeout, then /health answers at once: a living engine's error
    assert str(e.value) == f"pause of engine 0 ({health_url}) did not finish within 0.5 s"
    assert monitor.slots[0].state == "up" and recovery.version == 0
    hang.set()
    monitor.stop()
