"""Fixtures shared by the integration test modules (plain helpers are in ``helpers.py``):

- ``prompt_file``: 16 "Count from i" prompts for the tiny-model `vime run` tests (one file per module).
- ``runs``: the :class:`tests.integration.helpers.Run` subprocesses a test starts, killed with every process they
  left when it ends.
- ``prompt_ids`` and ``engine_at_v0``: the weight-sync tests' prompt tokens and the shared server at version 0
  (``module_engine_at_v0``: the same for a module), also the running engine of `vime run --rollout-external` tests.
- ``ray_cluster``: this test process's Ray cluster, which `vime run`s whose test is not about Ray's start join
  (``helpers.ray_flags``) instead of starting one each (docs/testing.md, "Shared runs").
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.helpers import PROMPT_TEXT, ROOT, Run


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """``train.jsonl`` with 16 prompts ``Count from i: i i+1`` labelled ``i+2``."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Count from {i}: {i} {i + 1}", "label": str(i + 2)}) + "\n")
    return path


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """A list the test appends its :class:`Run` objects to; each is closed (killed, nothing left) afterwards."""
    started: list[Run] = []
    yield started
    for r in started:
        r.close()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> list[int]:
    """``PROMPT_TEXT`` tokenized (test_rollout_engine.py has its own prompt under this name)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))(PROMPT_TEXT)["input_ids"]


@contextmanager
def _at_v0(server, model_dir: Path) -> Iterator:
    """``server`` holding ``model_dir`` as delta version 0; its weights and version label restored afterwards."""
    label = server.weight_version()
    server.collective_rpc("vime_load_weights", args=[str(model_dir)], kwargs={"version": 0})
    server.reset_prefix_cache()
    try:
        yield server
    finally:
        server.collective_rpc("vime_load_weights", args=[str(model_dir)], kwargs={"version": 0})
        server.reset_prefix_cache()
        server.set_weight_version(label if label is not None else "default")


@pytest.fixture
def engine_at_v0(vllm_server, tiny_model_dir):
    """The shared server holding ``tiny_model_dir`` as delta version 0; restored after the test (which may change
    its weights, e.g. a `vime run --rollout-external` on it)."""
    with _at_v0(vllm_server, tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def module_engine_at_v0(vllm_server, tiny_model_dir):
    """:func:`engine_at_v0` for a module-scoped fixture: restored when the module's tests are done."""
    with _at_v0(vllm_server, tiny_model_dir) as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The GCS address of a one-node Ray cluster on 127.0.0.1 for this test process (each xdist worker has its own),
    started on first use and stopped at the session's end; a `vime run` joins it with ``helpers.ray_flags``.

    Started as vime starts its own Ray (every core, no dashboard, worker niceness 0) with the environment a user's
    ``ray start`` for vime would have: this checkout on ``PYTHONPATH`` (dotted-path plugins of tests/ import in the
    actors) and vime's quiet-worker variables. Joined actors inherit that environment, not the driver's, so a run whose
    test sets variables for its actors keeps its own Ray, and so does one whose test is about Ray's start or about the
    processes a run leaves. A private temporary directory keeps plain ``ray.init()`` elsewhere from finding it.
    """
    from vime_core.cluster.orchestration import QUIET_WORKER_ENV  # vime_core first: Ray stays on 127.0.0.1

    from ray.cluster_utils import Cluster  # isort: skip

    tmp = tempfile.mkdtemp(prefix="vrw-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {
        "RAY_TMPDIR": tmp,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        **QUIET_WORKER_ENV,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the head's processes (and so every actor) inherit it
    try:
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={
                "num_cpus": os.cpu_count(),
                "include_dashboard": False,
                "_system_config": {"worker_niceness": 0},
            },
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
