"""The examples' configs parse, their local modules load, and their helpers compute exact values (no engine).

The examples' generate functions run against the real engine in tests/integration/test_examples_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vime_core.arguments import parse_run_args
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fully_async", {"loop": "fully-async", "max_staleness": 1, "train_cpus": "1", "rollout_cpu_bind": ["0"]}),
        ("multi_agent", {"generate": "solver_verifier:generate", "reward": "solver_verifier:team_reward"}),
        (
            "tool_use",
            {"generate": "multi_turn", "multi_turn_tools": ["number_tools", "vime_core.rollout.tools:calculator"]},
        ),
        (
            "train_infer_mismatch",
            {
                "get_mismatch_metrics": True,
                "use_rollout_correction": True,
                "use_tis": True,
                "use_rs": True,
                "rs_level": "geometric",
                "rs_upper_bound": 1.05,
                "rs_veto_threshold": 1e-4,
            },
        ),
    ],
)
def test_example_config_parses(name, expected):
    args = parse_run_args(["--config", str(EXAMPLES / name / "config.yaml")])
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.prompt_data.exists()
    first = json.loads(args.prompt_data.read_text().splitlines()[0])
    assert first["metadata"]["task"] and first["metadata"]["rg_entry"]["answer"] == first["label"]


def test_tool_use_tools(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "tool_use"))
    from vime_core.rollout.tools import load_tools

    tools = {t.name: t for t in load_tools(["number_tools", "vime_core.rollout.tools:calculator"])}
    assert sorted(tools) == ["calculator", "gcd", "lcm"]
    assert asyncio.run(tools["lcm"].call({"a": 12, "b": 18})) == "36"
    assert asyncio.run(tools["gcd"].call({"a": "84", "b": 36})) == "12"
    assert tools["lcm"].schema()["parameters"]["required"] == ["a", "b"]


def test_multi_agent_verdict_and_team_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_agent"))
    import solver_verifier as sv

    assert sv.parse_verdict("Verdict: Incorrect.") == "incorrect"
    assert sv.parse_verdict("I think verdict:correct") == "correct"
    assert sv.parse_verdict("Answer: 3") is None
    assert sv.parse_verdict("The proposed answer is indeed incorrect. While 9 + 2 is right") == "incorrect"
    assert sv.parse_verdict("No, the proposed answer is not correct") == "incorrect"
    assert sv.parse_verdict("That is right.") == "correct"
    row = json.loads((EXAMPLES / "quickstart" / "data" / "train.jsonl").read_text().splitlines()[0])
    right, wrong = row["label"], str(int(row["label"]) + 1)
    s = Sample(prompt=row["prompt"], metadata=dict(row["metadata"]), response=f"Answer: {wrong}")
    s.metadata["final_response"] = f"Answer: {right}"  # the revision was right: the team reward follows it
    assert asyncio.run(sv.team_reward(plugin_context(), s)) == 1.0
    s.metadata["final_response"] = f"Answer: {wrong}"
    assert asyncio.run(sv.team_reward(plugin_context(), s)) == 0.0
