"""Regenerate the tool_use example's prompt data (examples/tool_use/data/{train,eval}.jsonl).

Task: reasoning-gym ``lcm`` — the least common multiple of two numbers in 1..100 (e.g. ``Find the Least Common
Multiple (LCM) of these numbers: 98, 58``), which SmolLM2-135M-Instruct cannot compute in its head but can get from
the example's ``lcm`` tool (``number_tools.py``; a ``gcd`` tool and the built-in calculator are offered too, so the
model has to pick). Each prompt is a system line, three worked examples that call a tool (OpenAI-format chat turns:
the call, the tool's result, the answer), then the question.

    python examples/tool_use/make_data.py [--out-dir DIR] [--train-size 256] [--eval-size 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_core.data.reasoning_gym_export import export_reasoning_gym

TASK = "lcm"
CONFIG = {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}
SYSTEM_PROMPT = (
    "You are a careful assistant with number tools. Call the right tool, then reply with one line of the form "
    "'Answer: N' where N is the final number."
)
TRAIN_SEED, EVAL_SEED = 1357, 9753


def tool_example(question: str, name: str, arguments: dict, result: str) -> list[dict]:
    """One worked example as chat turns: the question, a tool call, its result, the final answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


EXAMPLES = [
    *tool_example("Find the Least Common Multiple (LCM) of these numbers: 12, 18", "lcm", {"a": 12, "b": 18}, "36"),
    *tool_example("Find the Greatest Common Divisor (GCD) of these numbers: 84, 36", "gcd", {"a": 84, "b": 36}, "12"),
    *tool_example("Find the Least Common Multiple (LCM) of these numbers: 45, 20", "lcm", {"a": 45, "b": 20}, "180"),
]


def with_tool_examples(path: Path) -> None:
    """Insert the worked examples after the system message of every row (rewrites ``path``)."""
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
