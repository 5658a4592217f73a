"""Regenerate the retool example's prompt data (examples/retool/data/{train,eval}.jsonl).

Task: reasoning-gym ``basic_arithmetic`` with two three-digit operands (+ - *), e.g. ``Calculate 347 * 861.`` — out
of reach for SmolLM2-135M-Instruct in its head, one ``print`` for the code interpreter. Each prompt is a system
line, three worked examples that run code (OpenAI-format chat turns: a ``code_interpreter`` call, its output, the
answer), then the question; ``multi_turn`` renders the tool's schema into the system prompt (Hermes format).

    python examples/retool/make_data.py [--out-dir DIR] [--train-size 256] [--eval-size 64]
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
    "min_digits": 3,
    "max_digits": 3,
    "operators": ["+", "-", "*"],
    "allow_negation": False,
    "allow_parentheses": False,
}
SYSTEM_PROMPT = (
    "You are a careful assistant with a Python code interpreter. Compute the result with code, then reply with one "
    "line of the form 'Answer: N' where N is the final number."
)
TRAIN_SEED, EVAL_SEED = 5150, 6260


def code_example(question: str, code: str, output: str) -> list[dict]:
    """One worked example as chat turns: the question, a code_interpreter call, its output, the final answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "code_interpreter", "arguments": json.dumps(
        {"code": code})}}  # fmt: skip
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": output},
        {"role": "assistant", "content": f"Answer: {output}"},
    ]


EXAMPLES = [
    *code_example("Calculate 218 * 457.", "print(218 * 457)", "99626"),
    *code_example("Calculate 903 - 476.", "print(903 - 476)", "427"),
    *code_example("Calculate 385 + 729.", "print(385 + 729)", "1114"),
]


def with_code_examples(path: Path) -> None:
    """Insert the worked examples after the system message of every row (rewrites ``path``)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["prompt"] = [row["prompt"][0], *EXAMPLES, row["prompt"][-1]]
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
        with_code_examples(path)
        print(f"{split}: {size} rows -> {path}")


if __name__ == "__main__":
    main()
