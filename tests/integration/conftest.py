"""Fixtures shared by the integration test modules (plain helpers are in ``helpers.py``):

- ``prompt_file``: 16 "Count from i" prompts for the tiny-model `vime run` tests (one file per module).
- ``runs``: the :class:`tests.integration.helpers.Run` subprocesses a test starts, killed with every process they
  left when it ends.
- ``prompt_ids`` and ``engine_at_v0``: the weight-sync tests' prompt tokens and the shared server at version 0
  (``module_engine_at_v0``: the same for a module), also the running engine of `vime run --rollout-external` tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.helpers import PROMPT_TEXT, Run


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
