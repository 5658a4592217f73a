"""One metrics sink: TensorBoard scalars (``OUTPUT_DIR/tensorboard``) and ``OUTPUT_DIR/metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsSink:
    """Write a step's float metrics to TensorBoard (when enabled) and a jsonl file.

    :param out_dir: the run's output directory.
    :param use_tensorboard: also write TensorBoard event files.
    """

    def __init__(self, out_dir: Path, use_tensorboard: bool = True) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
