"""Print the weight-sync bytes of a run, per step, against a full sync of the same weights.

    python examples/delta_weight_sync/sync_bytes.py OUTPUT_DIR

Reads ``OUTPUT_DIR/metrics.jsonl``: ``weight_sync/bytes`` (what the sync wrote) and ``weight_sync/full_bytes``
(the whole version's bytes, what ``--weight-sync disk`` writes; reported by ``disk-delta``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIB = 1 << 20


def sync_table(out_dir: Path) -> list[tuple[int, float, float]]:
    """``[(step, bytes, full_bytes)]`` of every training record of ``OUT/metrics.jsonl`` with a weight sync.

    :raises FileNotFoundError: no ``metrics.jsonl`` in ``out_dir``.
    :raises ValueError: a sync record without ``weight_sync/full_bytes`` (not a ``disk-delta`` run), naming the step.
    """
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (the output directory of a vime run)")
    rows = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "weight_sync/bytes" not in rec:
            continue  # an evaluation record
        if "weight_sync/full_bytes" not in rec:
            raise ValueError(
                f"{path}: step {rec['step']} has no weight_sync/full_bytes: not a --weight-sync disk-delta run"
            )
        rows.append((int(rec["step"]), rec["weight_sync/bytes"], rec["weight_sync/full_bytes"]))
    return rows


def format_table(rows: list[tuple[int, float, float]]) -> str:
    """The table :func:`main` prints: one line per sync (MiB written, MiB of a full sync, percent), then the total."""
    lines = [f"{'step':>4}  {'written MiB':>11}  {'full MiB':>9}  {'written/full':>12}"]
    for step, nbytes, full in rows:
        lines.append(f"{step + 1:>4}  {nbytes / MIB:>11.1f}  {full / MIB:>9.1f}  {100 * nbytes / full:>11.1f}%")
    written, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"{'all':>4}  {written / MIB:>11.1f}  {total / MIB:>9.1f}  {100 * written / max(total, 1):>11.1f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    print(format_table(sync_table(parser.parse_args().output_dir)))


if __name__ == "__main__":
    main()
