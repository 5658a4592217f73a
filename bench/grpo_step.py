"""Wall-time split of GRPO steps (rollout / train / weight sync) for the quickstart config on this machine.
Runs ``vime run`` for a few steps and prints the per-step split from its metrics; asserts nothing.

    .venv/bin/python bench/grpo_step.py [--steps 3] [--config examples/quickstart/config.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/quickstart/config.yaml")
    ap.add_argument("--steps", type=int, default=3)
    a, extra = ap.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="vime-bench-"))
    cmd = [
        sys.executable,
        "-m",
        "vime_core.cli",
        "run",
        "--config",
        a.config,
        "--num-rollout",
        str(a.steps),
        "--output-dir",
        str(out),
        "--no-save-hf",
        *extra,
    ]
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"\nGRPO step wall time split ({a.config}, {len(rows)} steps):")
    print(
        f"  {'step':>4} {'rollout s':>10} {'train s':>10} {'sync s':>10} {'total s':>10} {'sync MB':>9} {'reward':>7}"
    )
    for r in rows:
        print(
            f"  {r['step']:>4} {r['perf/rollout_time']:>10.2f} {r['perf/train_time']:>10.2f}"
            f" {r['perf/sync_time']:>10.2f}"
            f" {r['perf/step_time']:>10.2f} {r['weight_sync/bytes'] / 2**20:>9.1f} {r['rollout/reward_mean']:>7.3f}"
        )
    keys = ("perf/rollout_time", "perf/train_time", "perf/sync_time", "perf/step_time")
    means = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    share = {k: 100 * means[k] / means["perf/step_time"] for k in keys[:3]}
    print(
        f"  mean: rollout {means[keys[0]]:.2f} s ({share[keys[0]]:.0f}%), train {means[keys[1]]:.2f} s "
        f"({share[keys[1]]:.0f}%), sync {means[keys[2]]:.2f} s ({share[keys[2]]:.0f}%), step {means[keys[3]]:.2f} s"
    )


if __name__ == "__main__":
    main()
