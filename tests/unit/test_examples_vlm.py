"""The vision-language examples without an engine: their configs parse, their data loads with its figures through
``read_rows`` (paths relative to the data file), every answer follows from the figure's labelled measures, and the
multi-turn example's tools return a crop that loads as an image. The runs: tests/integration/test_vlm_vllm.py."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from vime_core.cli.arguments import parse_run_args
from vime_core.data.images import decode_image
from vime_core.data.source import read_rows
from vime_core.data.vision_prompt import tool_result_parts

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("geo3k_vlm", {"image_key": "images", "input_key": "problem", "reward": "math", "generate": "default"}),
        (
            "geo3k_vlm_multi_turn",
            {"image_key": "images", "generate": "multi_turn", "multi_turn_tools": ["figure_tools"]},
        ),
    ],
)
def test_vlm_example_configs_parse_and_their_data_loads(name, expected):
    args = parse_run_args(["--config", str(EXAMPLES / name / "config.yaml")])
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.vllm_args[0] == "--limit-mm-per-prompt"
    for split in ("train", "eval"):
        rows = read_rows(
            args.prompt_data.parent / f"{split}.jsonl", "problem", "answer", "metadata", image_key="images"
        )
        assert len(rows) == (64 if split == "train" else 16)
        for r in rows:
            assert len(r["images"]) == 1 and decode_image(r["images"][0]).size == (224, 224)
            assert r["prompt"][0]["content"][0] == {"type": "image"}  # the <image> marker, first
            assert r["prompt"][0]["content"][1]["text"].endswith("Put the final answer (a number) in \\boxed{}.")


def test_every_answer_follows_from_the_labelled_measures():
    kinds = set()
    for line in (EXAMPLES / "geo3k_vlm" / "data" / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        m, kind = row["metadata"]["measures"], row["metadata"]["kind"]
        kinds.add(kind)
        if kind == "triangle":
            expected = 180 - m["angle_A"] - m["angle_B"]
        elif kind == "right_triangle":
            expected = math.isqrt(m["legs"][0] ** 2 + m["legs"][1] ** 2)
        elif kind == "circle":
            expected = 2 * m["radius"]
        elif kind == "straight_angle":
            expected = 180 - m["angle"]
        else:
            expected = m["width"] * m["height"]
        assert row["answer"] == str(expected), row
    assert kinds == {"triangle", "right_triangle", "circle", "straight_angle", "rectangle"}


def test_the_multi_turn_tools_return_a_crop_and_a_measure(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "geo3k_vlm_multi_turn"))
    from vime_core.rollout.generators.tools import load_tools

    tools = {t.name: t for t in load_tools(["figure_tools"])}
    assert sorted(tools) == ["measure", "zoom"]
    result = asyncio.run(tools["zoom"].call({"figure": "train_000", "region": "top-left"}))
    text, images = tool_result_parts(result, Path.cwd())
    assert text == "top-left of train_000, magnified 2x:" and len(images) == 1
    assert decode_image(images[0]).size == (224, 224)
    assert asyncio.run(tools["measure"].call({"figure": "train_000", "name": "angle_A"})) == "30"
    assert asyncio.run(tools["measure"].call({"figure": "train_000", "name": "side"})) == (
        "train_000 has no measure 'side'; it has angle_A, angle_B"
    )
    with pytest.raises(ValueError, match="unknown figure 'x'"):
        asyncio.run(tools["zoom"].call({"figure": "x", "region": "center"}))
