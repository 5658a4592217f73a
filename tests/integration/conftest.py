"""Fixtures shared by the integration test modules (plain helpers are in ``helpers.py``):

- ``prompt_file``: 16 "Count from i" prompts for the tiny-model `vime run` tests (one file per module).
- ``runs``: the :class:`tests.integration.helpers.Run` subprocesses a test starts, killed with every process they
  left when it ends.
- ``prompt_ids`` and ``engine_at_v0``: the weight-sync tests' prompt tokens and the shared server at version 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


@pytest.fixture
def engine_at_v0(vllm_server, tiny_model_dir):
    """The shared server holding ``tiny_model_dir`` as delta version 0; restored afterwards."""
    label = vllm_server.weight_version()
    vllm_server.collective_rpc("vime_load_weights", args=[str(tiny_model_dir)], kwargs={"version": 0})
    vllm_server.reset_prefix_cache()
    try:
        yield vllm_server
    finally:
        vllm_server.collective_rpc("vime_load_weights", args=[str(tiny_model_dir)], kwargs={"version": 0})
        vllm_server.reset_prefix_cache()
        vllm_server.set_weight_version(label if label is not None else "default")
