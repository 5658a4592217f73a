"""Reproducible rollouts: every sample's engine request carries a seed derived from ``--seed``, the step, the group
and the sample index — the same for the same run, distinct within a group."""

from __future__ import annotations

import hashlib

import pytest

from tests.support.rollout import manager_with_hooks
from vime_core.rollout.runner import sample_seed

pytestmark = pytest.mark.unit


def test_sample_seed_exact_values():
    assert sample_seed(1234, 0, 0, 0) == 1118507700034275484
    assert sample_seed(1234, 0, 0, 1) == 2697656557643449520  # another sample of the group
    assert sample_seed(1234, 1, 0, 0) == 7769684710179869452  # the same sample resumed in a later step
    assert sample_seed(1235, 0, 0, 0) == 5366841475662028129  # another --seed
    assert sample_seed(0, -1, 7, 3) == 4946167805780881054  # fully-async's producer (step -1)
    digest = hashlib.blake2b(b"vime-rollout-seed:1234:0:0:0", digest_size=8).digest()
    assert sample_seed(1234, 0, 0, 0) == int.from_bytes(digest, "little") & (2**63 - 1)


def test_sample_seeds_are_distinct_non_negative_int64():
    seeds = {sample_seed(1234, step, g, i) for step in range(20) for g in range(20) for i in range(16)}
    assert len(seeds) == 20 * 20 * 16
    assert all(0 <= s < 2**63 for s in seeds)


def test_manager_sends_each_sample_its_seed(tiny_model_dir, tmp_path):
    seen: dict[tuple[int, int], int] = {}

    async def record(args, sample, sampling_params):
        seen[(sample.group_index, sample.index)] = sampling_params["seed"]
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0)
        sample.status = sample.status.COMPLETED
        return sample

    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=record, seed=77)
    m.generate(3)
    assert seen == {(g, i): sample_seed(77, 3, g, i) for g in (0, 1) for i in (0, 1)}
