"""The rollout side of what a new user hit (issue 35, part 2): a 4xx answer (a request the engine refuses) is
never retried and fails its sample at once with the status and vLLM's own message; the samples regenerated after an
engine failure are one log line, not one per sample; samples failing with the same error are one line plus a count.

The engine here is a real HTTP server on 127.0.0.1 answering as vLLM does (its JSON error body), met by the real
:class:`~vime_core.engines.client.RouterClient`; the health monitor runs with the stand-ins of
``tests/support/engine_stand_ins.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.support.engine_stand_ins import FAST, Engine, Router, disk_recovery
from vime_core.engines.answers import is_client_error
from vime_core.engines.client import RouterClient, RouterClientError
from vime_core.engines.health import EngineMonitor, generate_with_retries
from vime_core.failures import FailureCause, classify_failure
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.unit

VLLM_400 = {
    "error": {
        "message": "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }
}


class _Engine(BaseHTTPRequestHandler):
    """``/health`` 200; every POST answers the class's ``status`` with ``body`` and is counted."""

    status, body, posts = 400, json.dumps(VLLM_400), [0]

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts[0] += 1
        data = self.body.encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a) -> None:
        pass


@pytest.fixture
def engine_url():
    _Engine.posts[0] = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_error_answer_carries_its_status_and_vllms_message():
    e = RouterClientError("x", 400)
    assert (e.status, is_client_error(e)) == (400, True)
    for status, client in ((404, True), (422, True), (408, False), (429, False), (500, False), (503, False)):
        assert is_client_error(RouterClientError("x", status)) is client, status
    assert is_client_error(RouterClientError("malformed body")) is False
    assert is_client_error(httpx.ReadError("peer closed")) is False


def test_a_4xx_is_not_retried_and_fails_the_sample_with_status_and_message(tmp_path, engine_url):
    recovery, _ = disk_recovery(tmp_path)
    monitor = EngineMonitor([Engine(engine_url, tmp_path / "e0.log")], Router([engine_url]), recovery, FAST)
    monitor.start()

    async def generate(ctx, sample, params):
        async with RouterClient(engine_url, "policy", eos_token_ids=[2]) as client:
            await client.generate([1, 2, 3], {"temperature": -1.0, "max_tokens": 4})

    try:
        with pytest.raises(RouterClientError) as e:
            asyncio.run(generate_with_retries(monitor, generate, plugin_context(), Sample(prompt="p"), {}))
        assert str(e.value) == (
            f"POST {engine_url}/inference/v1/generate returned 400: temperature must be non-negative, got -1.0. "
            "(parameter=temperature, value=-1.0)"
        )
        assert e.value.status == 400
        assert _Engine.posts[0] == 1  # sent once: FAST allows 3 retries of an engine error
        assert monitor.take_metrics()["rollout/requests_retried"] == 0.0
        assert classify_failure(e.value, "generate") == FailureCause.ENGINE_ERROR
    finally:
        monitor.stop()


def test_an_error_body_without_vllms_shape_is_kept_as_it_is(engine_url, monkeypatch):
    monkeypatch.setattr(_Engine, "status", 503)
    monkeypatch.setattr(_Engine, "body", "upstream down")

    async def go():
        async with RouterClient(engine_url, "policy", eos_token_ids=[2], api="generate") as client:
            await client.generate([1, 2], {"max_tokens": 4})

    with pytest.raises(RouterClientError) as e:
        asyncio.run(go())
    assert str(e.value) == f"POST {engine_url}/inference/v1/generate returned 503: upstream down"
    assert e.value.status == 503


def test_samples_regenerated_after_an_engine_failure_are_one_log_line(tmp_path, engine_url, caplog):
    recovery, _ = disk_recovery(tmp_path)
    monitor = EngineMonitor([Engine(engine_url, tmp_path / "e0.log")], Router([engine_url]), recovery, FAST)
    monitor.start()
    failed: set[int] = set()

    async def generate(ctx, sample, params):
        if sample.index not in failed:  # every sample's first attempt meets the dying engine
            failed.add(sample.index)
            await asyncio.sleep(0.01)
            raise httpx.ReadError("peer closed connection")
        return sample

    async def all_samples():
        samples = [Sample(prompt="p", index=i, group_index=7) for i in range(32)]
        return await asyncio.gather(*(generate_with_retries(monitor, generate, plugin_context(), s, {})
                                      for s in samples))  # fmt: skip

    caplog.set_level(logging.WARNING, logger="vime.rollout")
    try:
        out = asyncio.run(all_samples())
    finally:
        monitor.stop()
    assert len(out) == 32 and monitor.take_metrics()["rollout/requests_retried"] == 32.0
    lines = [r.getMessage() for r in caplog.records if r.name == "vime.rollout"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("32 sample(s) failed on an engine error and are generated again now that an engine "
                               "serves (first: sample 7/")  # fmt: skip
    assert lines[0].endswith(": ReadError: peer closed connection)")


def test_samples_failing_with_the_same_error_are_one_line_and_a_count(tiny_model_dir, tmp_path, caplog):
    """A real rollout manager (no engine: the generate function raises as a refused request does) over 3 groups of
    4: the step fails at once, with one line for its 12 samples' failures."""
    from tests.support.rollout import manager_with_hooks
    from vime_core.failures import RunFailedError

    error = "POST http://127.0.0.1:1/inference/v1/generate returned 400: max_tokens must be at least 1, got 0."

    async def refused(args, sample, sampling_params):
        raise RouterClientError(error, 400)

    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=refused, num_prompts=3, rollout_batch_size=3,
                           n_samples_per_prompt=4)  # fmt: skip
    caplog.set_level(logging.WARNING, logger="vime.rollout")
    with pytest.raises(RunFailedError) as e:
        m.generate(0)
    assert str(e.value) == (
        f"every sample of step 0 failed (12 of 12); first error: RouterClientError: {error} (engine and router logs: "
        f"{m.config.output_dir}/logs)"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "vime.rollout"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sample ") and lines[0].endswith(f" failed (engine_error): RouterClientError: {error}")
    assert lines[1] == f"11 more sample(s) failed (engine_error) with the same error: RouterClientError: {error}"
