"""Regenerate the quickstart prompt data (examples/quickstart/data/{train,eval}.jsonl) with vime's exporter.

Task: reasoning-gym ``basic_arithmetic``, two one-digit operands, + - * (no division, negation or parentheses); a
one-line "Answer: N" system prompt and two worked examples as earlier chat turns. SmolLM2-135M-Instruct scores about
0.49 on it at temperature 1.0 (see README.md), so GRPO has signal from the first step.

    python examples/quickstart/make_data.py [--out-dir DIR] [--train-size 512] [--eval-size 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vime_core.data.reasoning_gym_export import export_reasoning_gym

TASK = "basic_arithmetic"
CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "allow_negation": False,
    "allow_parentheses": False,
    "operators": ["+", "-", "*"],
}
SYSTEM_PROMPT = (
    "You are a calculator. Reply with one line of the form 'Answer: N' where N is the final number. Do not explain."
)
FEW_SHOT = (("Calculate 3 + 5.", "Answer: 8"), ("Calculate 6 * 2.", "Answer: 12"))
TRAIN_SEED, EVAL_SEED = 1234, 98765


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--eval-size", type=int, default=64)
    args = parser.parse_args()
    for split, size, seed in (("train", args.train_size, TRAIN_SEED), ("eval", args.eval_size, EVAL_SEED)):
        path = export_reasoning_gym(
            TASK, size, seed, args.out_dir / f"{split}.jsonl", CONFIG, system_prompt=SYSTEM_PROMPT, few_shot=FEW_SHOT
        )
        print(f"{split}: {size} rows -> {path}")


if __name__ == "__main__":
    main()
