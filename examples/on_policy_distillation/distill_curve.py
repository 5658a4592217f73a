"""Print an on-policy distillation run's loss per step: the reverse KL of student to teacher on the sampled tokens.

    python examples/on_policy_distillation/distill_curve.py OUTPUT_DIR

Reads ``OUTPUT_DIR/metrics.jsonl``: ``rollout/distill_reverse_kl`` (the mean over trained tokens of
``logπ_S - logπ_T``, nats; the loss distillation drives down) and ``rollout/reward_mean`` per training step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def distill_curve(out_dir: Path) -> list[tuple[int, float, float]]:
    """``[(step, reverse_kl, reward_mean)]`` of every training record of ``OUT/metrics.jsonl``.

    :raises FileNotFoundError: no ``metrics.jsonl`` in ``out_dir``.
    :raises ValueError: a training record without ``rollout/distill_reverse_kl`` (no ``--distill-teacher``).
    """
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (the output directory of a vime run)")
    rows = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "rollout/reward_mean" not in rec:
            continue  # an evaluation record
        if "rollout/distill_reverse_kl" not in rec:
            raise ValueError(f"{path}: step {rec['step']} has no rollout/distill_reverse_kl: no --distill-teacher")
        rows.append((int(rec["step"]), rec["rollout/distill_reverse_kl"], rec["rollout/reward_mean"]))
    return rows


def format_curve(rows: list[tuple[int, float, float]]) -> str:
    """One line per step (1-based, as the progress line counts): reverse KL and mean reward."""
    lines = [f"{'step':>4}  {'reverse KL (nats/token)':>23}  {'reward':>6}"]
    lines += [f"{step + 1:>4}  {kl:>23.4f}  {reward:>6.3f}" for step, kl, reward in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    print(format_curve(distill_curve(parser.parse_args().output_dir)))


if __name__ == "__main__":
    main()
