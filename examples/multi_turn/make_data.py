"""Regenerate the multi_turn example's prompt data (examples/multi_turn/data/{train,eval}.jsonl).

Task: reasoning-gym ``basic_arithmetic`` with two two-digit operands (+ - *), e.g. ``Calculate 47 * 38.`` — hard for
SmolLM2-135M-Instruct to do in its head, easy with the calculator tool. Each prompt is a system line, three worked
examples that *use the tool* (as earlier chat turns in OpenAI format: an assistant tool call, the tool's result, the
final answer), then the question. ``multi_turn`` renders the calculator's schema into the system prompt itself
(``--multi-turn-tool-prompt auto``), and renders the example's tool call and result exactly as it renders live ones.

    python examples/multi_turn/make_data.py [--out-dir DIR] [--train-size 256] [--eval-size 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_core.data.reasoning_gym_export import export_reasoning_gym

TASK = "basic_arithmetic"
CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 2,
    "max_digits": 2,
    "operators": ["+", "-", "*"],
    "allow_negation": False,
    "allow_parentheses": False,
}
SYSTEM_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic, then reply with one line of the form "
    "'Answer: N' where N is the final number."
)


def tool_example(question: str, expression: str, result: str) -> list[dict]:
    """One worked example as chat turns: the question, a calculator call, its result, the final answer."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


# three worked examples (one per operator): with one, SmolLM2-135M never calls the tool; with three it does about half
# the time (see README.md)
EXAMPLES = [
    *tool_example("Calculate 23 * 19.", "23 * 19", "437"),
    *tool_example("Calculate 85 - 47.", "85 - 47", "38"),
    *tool_example("Calculate 36 + 58.", "36 + 58", "94"),
]
TRAIN_SEED, EVAL_SEED = 4321, 8765


def with_tool_examples(path: Path) -> None:
    """Insert the tool-using worked examples after the system message of every row (rewrites ``path``)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        system, question = row["prompt"][0], row["prompt"][-1]
        row["prompt"] = [system, *EXAMPLES, question]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--eval-size", type=int, default=64)
    args = parser.parse_args()
    for split, size, seed in (("train", args.train_size, TRAIN_SEED), ("eval", args.eval_size, EVAL_SEED)):
        path = export_reasoning_gym(
            TASK, size, seed, args.out_dir / f"{split}.jsonl", CONFIG, system_prompt=SYSTEM_PROMPT, few_shot=()
        )
        with_tool_examples(path)
        print(f"{split}: {size} rows -> {path}")


if __name__ == "__main__":
    main()
