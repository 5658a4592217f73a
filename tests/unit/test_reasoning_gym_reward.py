"""reasoning-gym reward: answer extraction from SmolLM2-style outputs and exact scores via score_answer."""

import asyncio
import json

import pytest

from vime_core.data.reasoning_gym_export import export_reasoning_gym
from vime_core.rewards.reasoning_gym import extract_answer, reasoning_gym_reward
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.unit

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = export_reasoning_gym("chain_sum", 8, 7, tmp_path_factory.mktemp("rg") / "chain.jsonl", CONFIG)
    return [json.loads(line) for line in out.read_text().splitlines()]


def reward(row, response):
    sample = Sample(prompt=row["prompt"], response=response, label=row["label"], metadata=row["metadata"])
    return asyncio.run(reasoning_gym_reward(plugin_context(), sample))


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Answer: 8", "8"),
        ("**Answer:** 12", "12"),
        ("Answer: 3 + 4 = 7.", "7"),
        ("The answer to the given arithmetic problem is 1.", "1"),
        ("The answer is -3. So it is less than 0.", "-3"),
        ("Answer: 12, because 6 * 2 = 12", "12"),
        ("Answer: 1,234", "1,234"),
        ("0 + 1 = 1", "1"),
        ("First 3 + 4 = 7, then 7 * 2 = 14 so", "14"),
        ("7", "7"),
        (" **42** ", "42"),
        ("<answer>42</answer>", "42"),
        ("We get \\boxed{5}.", "5"),
        ("Answer: 5\nExplanation: 2 + 3 = 5", "5"),
        ("2 when mixed with 6 gives a result of 6.", None),  # rambling: numbers are not guessed at
        ("Oh no!", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_rows_have_prompt_label_and_metadata(rows):
    assert len(rows) == 8
    row = rows[0]
    assert row["prompt"][0]["role"] == "system" and row["prompt"][-1]["role"] == "user"
    assert row["prompt"][-1]["content"] == row["metadata"]["rg_entry"]["question"]
    assert row["label"] == row["metadata"]["rg_entry"]["answer"]
    assert row["metadata"]["task"] == "chain_sum"
    assert row["metadata"]["rg_config"] == CONFIG


def test_correct_answer_scores_one_and_wrong_scores_zero(rows):
    for row in rows:
        label = row["label"]
        wrong = str(int(label) + 1)
        assert reward(row, f"Answer: {label}") == 1.0
        assert reward(row, f"Answer: {wrong}") == 0.0
        assert reward(row, "I do not know.") == 0.0


def test_same_seed_same_rows_and_other_seed_other_rows(tmp_path, rows):
    again = export_reasoning_gym("chain_sum", 8, 7, tmp_path / "a.jsonl", CONFIG)
    other = export_reasoning_gym("chain_sum", 8, 8, tmp_path / "b.jsonl", CONFIG)
    assert [json.loads(x) for x in again.read_text().splitlines()] == rows
    assert [json.loads(x) for x in other.read_text().splitlines()] != rows


@pytest.mark.parametrize("missing", ["task", "rg_entry"])
def test_missing_metadata_names_the_key(rows, missing):
    metadata = {k: v for k, v in rows[0]["metadata"].items() if k != missing}
    sample = Sample(response="Answer: 1", metadata=metadata)
    with pytest.raises(ValueError, match=f"missing key '{missing}'"):
        asyncio.run(reasoning_gym_reward(plugin_context(), sample))


def test_unknown_task_is_a_clear_error(rows):
    sample = Sample(response="Answer: 1", metadata={**rows[0]["metadata"], "task": "no_such_task"})
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'no_such_task'"):
        asyncio.run(reasoning_gym_reward(plugin_context(), sample))
