"""Make the multi_task_eval example's eval sets (examples/multi_task_eval/data/): two tasks beside the quickstart's.

* ``boxed.jsonl`` (32 rows, seed 4242): reasoning-gym ``basic_arithmetic`` (two one-digit terms, + - *) asked to be
  answered as ``\\boxed{N}`` (one worked example), scored by the ``math`` reward;
* ``copy.jsonl`` (32 rows, seed 4343): ``Repeat this word and nothing else: WORD`` with the word as label, scored by
  ``exact_match``.

The third task, ``arith``, is the quickstart's own eval set (``../quickstart/data/eval.jsonl``, ``reasoning_gym``).

    python examples/multi_task_eval/make_data.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from vime_core.data.reasoning_gym_export import export_reasoning_gym

BOXED_CONFIG = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+", "-", "*"],
    "allow_negation": False,
    "allow_parentheses": False,
}
BOXED_SYSTEM = r"Reply with the final number only, written as \boxed{N}."
BOXED_FEW_SHOT = (("Calculate 3 + 5.", r"\boxed{8}"),)
WORDS = ["apple", "river", "candle", "window", "garden", "pencil", "silver", "basket", "orange", "forest",
         "ladder", "mirror", "pepper", "rocket", "saddle", "tunnel", "violin", "wallet", "yellow", "zipper", "anchor",
         "button", "castle", "dragon", "engine", "feather", "guitar", "hammer", "island", "jacket", "kitten",
         "lemon"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    path = export_reasoning_gym(
        "basic_arithmetic", 32, 4242, args.out_dir / "boxed.jsonl", BOXED_CONFIG, system_prompt=BOXED_SYSTEM,
        few_shot=BOXED_FEW_SHOT,
    )  # fmt: skip
    print(f"boxed: 32 rows -> {path}")
    words = list(WORDS)
    random.Random(4343).shuffle(words)
    rows = [{"prompt": [{"role": "user", "content": f"Repeat this word and nothing else: {w}"}], "label": w}
            for w in words]  # fmt: skip
    path = args.out_dir / "copy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"copy: {len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
