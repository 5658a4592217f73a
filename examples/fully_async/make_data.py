"""Regenerate the fully_async prompt data (examples/fully_async/data/train.jsonl) with vime's exporter.

Task: reasoning-gym ``basic_arithmetic`` with three one- or two-digit terms and + - *, asked to be solved step by
step (one worked example as an earlier chat turn), so responses run to tens of tokens and generation costs about as
much as training: the regime where overlapping them pays (see README.md).

    python examples/fully_async/make_data.py [--out-dir DIR] [--train-size 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vime_core.data.reasoning_gym_export import export_reasoning_gym

TASK = "basic_arithmetic"
CONFIG = {
    "min_terms": 3,
    "max_terms": 3,
    "min_digits": 1,
    "max_digits": 2,
    "allow_negation": False,
    "allow_parentheses": False,
    "operators": ["+", "-", "*"],
}
SYSTEM_PROMPT = "Solve the arithmetic problem step by step, then finish with one line of the form 'Answer: N'."
FEW_SHOT = (("Calculate 4 * 12 - 7.", "First, 4 * 12 = 48. Then, 48 - 7 = 41.\nAnswer: 41"),)
TRAIN_SEED = 2468


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train-size", type=int, default=256)
    args = parser.parse_args()
    path = export_reasoning_gym(
        TASK,
        args.train_size,
        TRAIN_SEED,
        args.out_dir / "train.jsonl",
        CONFIG,
        system_prompt=SYSTEM_PROMPT,
        few_shot=FEW_SHOT,
    )
    print(f"train: {args.train_size} rows -> {path}")


if __name__ == "__main__":
    main()
