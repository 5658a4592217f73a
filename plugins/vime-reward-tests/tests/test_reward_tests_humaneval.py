"""HumanEval workspace tasks through the real tests reward (pytest in a ``local`` sandbox): the canonical solution
scores 1.0, the stub 0.0, and a solution that always answers True exactly the fraction of checks expecting True."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.data.humaneval_export import load_problems, problem_to_row
from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.contract


def _sample(row: dict, solution: str | None) -> Sample:
    meta = dict(row["metadata"])
    if solution is not None:
        meta["agent_result"] = {"changed": {"solution.py": solution}}
    return Sample(prompt=row["prompt"], metadata=meta)


def test_humaneval_rewards_exact():
    problems = {p["task_id"]: p for p in load_problems()}
    he0 = problem_to_row(problems["HumanEval/0"], include_solution=True)
    he32 = problem_to_row(problems["HumanEval/32"], include_solution=True)  # one seeded-loop test, helper poly()
    cases = [
        (_sample(he0, he0["metadata"]["canonical_solution"]), 1.0),
        (_sample(he0, None), 0.0),
        (_sample(he0, problems["HumanEval/0"]["prompt"] + "    return True\n"), 4 / 7),
        (_sample(he32, he32["metadata"]["canonical_solution"]), 1.0),
        (_sample(he32, None), 0.0),
    ]
    reward = get_plugins().resolve("reward", "tests")
    args = plugin_context(sandbox="local", reward_tests_timeout=60.0)

    async def run():
        return await asyncio.gather(*(reward(args, s) for s, _ in cases))

    assert asyncio.run(run()) == [e for _, e in cases]
    assert [c[0].metadata["reward_tests"]["total"] for c in cases] == [7, 7, 7, 1, 1]
