"""The ``remote`` reward against a real reward-model HTTP service on 127.0.0.1 (tests/contract/reward_model_server.py,
started in its own process): exact scores, the exact request body, the concurrency limit, retries with backoff,
timeouts, refusals, and a clear error when the service is down."""

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vime_core.failures import FailureCause, SampleFailure
from vime_core.plugins.manager import get_plugins
from vime_core.rewards.call import call_reward
from vime_core.rewards.remote import remote_reward
from vime_core.testing import RewardFunctionContract
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.contract


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rm_server():
    """The reward-model service's base URL (one process for the module)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reward_model_server.py")), str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"reward-model server did not start (exit {proc.poll()})") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def rm(rm_server):
    httpx.post(f"{rm_server}/reset").raise_for_status()
    return rm_server


def _args(url, **kw):
    base = {"rm_url": f"{url}/score", "rm_concurrency": 8, "rm_timeout": 10.0, "rm_max_retries": 3}
    return plugin_context(**(base | kw))


def _score(args, sample):
    return asyncio.run(remote_reward(args, sample))


class TestRemoteReward(RewardFunctionContract):
    @pytest.fixture
    def reward_fn(self):
        return get_plugins().resolve("reward", "remote")

    @pytest.fixture
    def reward_ctx(self, rm):
        return _args(rm)

    @pytest.fixture
    def cases(self):
        return [
            (Sample(response=" Paris ", label="paris"), 1.0),
            (Sample(response="London", label="Paris"), 0.0),
            (Sample(response="x", metadata={"raw": 0.25}), 0.25),  # a bare JSON number
            (Sample(response="x", metadata={"raw": {"reward": {"acc": 1, "len": 3}}}), {"acc": 1.0, "len": 3.0}),
        ]

    @pytest.fixture
    def error_cases(self):
        return [Sample(response="x", metadata={"status": 422})]


def test_request_body_is_prompt_response_label_metadata(rm):
    prompt = [{"role": "user", "content": "Capital of France?"}]
    sample = Sample(prompt=prompt, response="Paris", label="Paris", metadata={"id": "q1", "source": {"k": [1, 2]}})
    assert _score(_args(rm), sample) == 1.0
    assert httpx.get(f"{rm}/last").json() == {
        "prompt": prompt,
        "response": "Paris",
        "label": "Paris",
        "metadata": {"id": "q1", "source": {"k": [1, 2]}},
    }


def test_concurrency_limit(rm):
    """12 slow requests, --rm-concurrency 3: the service never sees more than 3 at once (and does see 3)."""
    args = _args(rm, rm_concurrency=3)

    async def run():
        samples = [Sample(response="a", label="a" if i % 2 else "b", metadata={"delay_s": 0.3}) for i in range(12)]
        return await asyncio.gather(*(remote_reward(args, s) for s in samples))

    assert asyncio.run(run()) == [0.0, 1.0] * 6
    stats = httpx.get(f"{rm}/stats").json()
    assert stats["max_inflight"] == 3 and len(stats["requests"]) == 12


def test_retries_with_exponential_backoff(rm):
    """Two 503s, then an answer: three requests, spaced by the backoff (0.5 s, then 1 s)."""
    got = _score(_args(rm), Sample(response="a", label="a", metadata={"id": "flaky", "fail_first": 2}))
    assert got == 1.0
    times = [r["t"] for r in httpx.get(f"{rm}/stats").json()["requests"]]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.5 and times[2] - times[1] >= 1.0


def test_retries_exhausted(rm):
    with pytest.raises(SampleFailure) as e:
        _score(_args(rm, rm_max_retries=1), Sample(response="a", metadata={"id": "down", "fail_first": 5}))
    assert e.value.failure_cause is FailureCause.REWARD_ERROR
    assert f"reward model at {rm}/score failed 2 attempt(s) (--rm-max-retries 1); last error: HTTP 503" in str(e.value)
    assert len(httpx.get(f"{rm}/stats").json()["requests"]) == 2


def test_a_refusal_is_not_retried(rm):
    with pytest.raises(SampleFailure, match=r"refused the sample: HTTP 422") as e:
        _score(_args(rm), Sample(response="a", metadata={"status": 422}))
    assert e.value.failure_cause is FailureCause.REWARD_ERROR
    assert len(httpx.get(f"{rm}/stats").json()["requests"]) == 1


def test_timeout(rm):
    with pytest.raises(SampleFailure, match=r"no answer within 0.3 s \(--rm-timeout\)") as e:
        _score(_args(rm, rm_timeout=0.3, rm_max_retries=1), Sample(response="a", metadata={"delay_s": 3}))
    assert e.value.failure_cause is FailureCause.REWARD_TIMEOUT
    assert len(httpx.get(f"{rm}/stats").json()["requests"]) == 2


def test_service_down_is_a_clear_error():
    url = f"http://127.0.0.1:{_free_port()}/score"  # nothing listens there
    with pytest.raises(SampleFailure) as e:
        _score(plugin_context(rm_url=url, rm_max_retries=0), Sample(response="a"))
    assert e.value.failure_cause is FailureCause.REWARD_ERROR
    assert str(e.value).startswith(f"reward model at {url} failed 1 attempt(s) (--rm-max-retries 0); last error: Conn")
    assert str(e.value).endswith("Is the service running and reachable from this machine?")


def test_a_non_number_answer_fails_the_sample(rm):
    """The service answers {"reward": "high"}: the rollout's check refuses it (reward_invalid), never 0."""
    with pytest.raises(SampleFailure, match="reward is str 'high', not a number") as e:
        asyncio.run(call_reward(remote_reward, _args(rm), Sample(response="a", metadata={"raw": {"reward": "high"}})))
    assert e.value.failure_cause is FailureCause.REWARD_INVALID


def test_missing_url_is_a_clear_error():
    with pytest.raises(ValueError, match="--reward remote needs --rm-url"):
        _score(plugin_context(), Sample(response="a"))
