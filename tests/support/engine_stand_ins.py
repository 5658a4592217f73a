"""Stand-ins for the engine processes and the router that record the calls the health monitor makes (their
``/health`` is served by the test); the real vLLM engines and vllm-router meet the monitor in
``tests/integration/test_fault_injection.py``."""

from __future__ import annotations

from pathlib import Path

from vime_core.engines.health import MonitorConfig
from vime_core.engines.weight_recovery import WeightRecovery
from vime_core.testing.plugin_context import run_config
from vime_core.weight_sync.disk import DiskWeightSync

#: a monitor that notices within a fraction of a second
FAST = MonitorConfig(
    max_restarts=2, backoff_s=0.0, interval_s=0.05, hang_timeout_s=0.3, startup_timeout_s=5.0, max_request_retries=3
)


class Engine:
    """Records the calls the monitor makes; ``alive`` is its process, ``url`` answers /health when alive."""

    def __init__(self, url: str, log_path: Path, fail_restarts: int = 0) -> None:
        self.url, self.log_path, self.alive = url, log_path, True
        self.calls: list[tuple] = []
        self.fail_restarts = fail_restarts

    def is_running(self) -> bool:
        return self.alive

    def exit_code(self) -> int | None:
        return None if self.alive else -9

    def restart(self) -> None:
        self.calls.append(("restart",))
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise RuntimeError("no memory left")
        self.alive = True

    def wait_ready(self, timeout_s: float) -> float:
        return 0.0

    def stop(self) -> None:
        self.calls.append(("stop",))

    def collective_rpc(self, method: str, args: list) -> list:
        self.calls.append((method, *args))
        return [1]

    def __getattr__(self, name: str):  # pause, resume, reset_prefix_cache, set_weight_version
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a: self.calls.append((name, *a))


class Router:
    """Records the worker changes the monitor makes; ``alive`` is its process."""

    def __init__(self, urls: list[str]) -> None:
        self.url, self.log_path, self.worker_urls = "http://127.0.0.1:1", Path("router.log"), list(urls)
        self.calls: list[tuple] = []
        self.alive = True
        self.proc = None

    def is_running(self) -> bool:
        return self.alive

    def remove_worker(self, url: str) -> None:
        self.calls.append(("remove", url))

    def add_worker(self, url: str) -> None:
        self.calls.append(("add", url))

    def stop(self) -> None:
        self.calls.append(("stop",))

    def start(self) -> None:
        self.calls.append(("start", tuple(self.worker_urls)))
        self.alive = True

    def wait_ready(self, timeout_s: float, require_workers: bool) -> float:
        return 0.0


def disk_recovery(tmp_path: Path) -> tuple[WeightRecovery, DiskWeightSync]:
    """The weight recovery of a replacement engine over a ``disk`` weight sync writing under ``tmp_path``."""
    ws = DiskWeightSync(run_config(update_weight_disk_dir=tmp_path / "weights", keep_weight_updates=False))
    return WeightRecovery(ws, tmp_path / "weights"), ws
