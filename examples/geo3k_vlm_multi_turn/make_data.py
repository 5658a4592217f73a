"""geo3k_vlm's questions with the figure named for the tools (``zoom``, ``measure``: figure_tools.py).

    python examples/geo3k_vlm_multi_turn/make_data.py       # data/{train,eval}.jsonl — checked in

Reads ``examples/geo3k_vlm/data/{train,eval}.jsonl`` (its figures stay there; the image paths here point at them)
and adds ``Figure: <id>.`` and the tool hint to each problem.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "geo3k_vlm" / "data"
INSTRUCTION = " Put the final answer (a number) in \\boxed{}."
HINT = " You may call zoom(figure, region) to see part of the figure magnified, or measure(figure, name)."


def convert(row: dict) -> dict:
    problem = row["problem"].removesuffix(INSTRUCTION)
    figure = row["metadata"]["figure"]
    return {
        **row,
        "problem": f"{problem} Figure: {figure}.{HINT}{INSTRUCTION}",
        "images": [f"../../geo3k_vlm/data/{p}" for p in row["images"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "data")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        rows = [convert(json.loads(line)) for line in (SOURCE / f"{split}.jsonl").read_text().splitlines()]
        (args.out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {args.out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
