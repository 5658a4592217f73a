"""The weight-sync strategy interface (built-ins and plugins implement it)."""

from __future__ import annotations

import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError

from vime_core.config import RunConfig
from vime_core.config.context import Engines

T = TypeVar("T")


class WeightWriteError(RuntimeError):
    """A weight version could not be written (full or read-only filesystem, ...): the message names the directory;
    no engine got anything, so every engine keeps serving the version it had."""


def write_version_dir(out: Path, write: Callable[[Path], None]) -> None:
    """Write one weight version into the directory ``out`` atomically: ``write(tmp)`` fills ``out.tmp``, which is
    then renamed to ``out`` (an engine never sees a half-written version). On failure the partial ``out.tmp`` is
    removed (it would only hold disk space) and an existing ``out`` is left as it was.

    :raises WeightWriteError: naming ``--update-weight-disk-dir``, the version directory and the OS error (e.g.
        ``No space left on device``, ``Read-only file system``).
    """
    tmp = out.with_name(out.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e)
        raise WeightWriteError(
            f"--update-weight-disk-dir {out.parent}: cannot write weight version directory {out.name}: {reason}; "
            "the engines keep their current weights"
        ) from None


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn()`` in a daemon thread and wait at most ``timeout_s`` seconds for it.

    A hung transfer (an engine that never answers) then fails the step with a clear error instead of hanging the
    run; the abandoned call keeps running in its thread until its own I/O gives up.

    :param fn: the blocking call.
    :param timeout_s: limit in seconds.
    :param what: description for the error message.
    :return: what ``fn`` returned.
    :raises TimeoutError: ``"<what> did not finish within <timeout_s> s"``.
    :raises BaseException: whatever ``fn`` raised.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="vime-weight-sync", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    if error:
        raise error[0]
    return result[0]


@dataclass
class WeightUpdate:
    """What the trainer side hands to the engine side for one version (picklable; crosses Ray actors).

    :ivar version: the new weight version (the trainer's step count after the update).
    :ivar payload: strategy-specific (a directory for ``disk``).
    :ivar num_bytes: bytes written/moved by the trainer side.
    :ivar seconds: trainer-side time in seconds.
    """

    version: int
    payload: dict[str, Any] = field(default_factory=dict)
    num_bytes: int = 0
    seconds: float = 0.0


class WeightSyncStrategy(ABC):
    """Moves HF-layout weights from a trainer to vLLM engines.

    Members: ``NAME``; ``run_config`` (the run's :class:`~vime_core.config.RunConfig`; a plugin strategy's own
    flags: ``run_config.plugin(ItsPluginConfig)``) and ``config`` (its :class:`~vime_core.config.WeightSyncConfig`);
    :meth:`push` (trainer side, returns a :class:`WeightUpdate`); :meth:`apply` (engine side, loads the update into
    one paused engine; :attr:`engines` gives the rollout side's router client and tokenizer); :meth:`read`
    (engine-side decoding without an engine — the contract kit uses it to check a bit-exact round trip);
    :meth:`cleanup` (drop what an applied update left behind).
    The rollout manager pauses every engine, calls :meth:`apply` for each, resets prefix caches, resumes, and
    bumps the weight version; the strategy only moves bytes.
    """

    NAME: str = ""
    #: whether :meth:`push_adapter` can hand a LoRA adapter to the engines (``--lora-rank`` > 0 needs it)
    CARRIES_LORA: bool = False
    #: where :meth:`push` wants the trainer's tensors: ``"cpu"``, or ``None`` for wherever the trainer holds them
    #: (GPU strategies: no round trip through host memory)
    TENSOR_DEVICE: str | None = "cpu"
    #: whether :meth:`apply` writes every weight of the model (a full reload, not a delta on top of the engine's
    #: weights): then a colocated engine sleeps at level 2 (its weights discarded, not kept in host memory) and
    #: wakes them without restoring them (docs/gpu.md, "The one-GPU layout")
    RELOADS_ALL_WEIGHTS: bool = False
    #: the rollout side's engines (:class:`~vime_core.config.context.Engines`: the router client, the tokenizer, the
    #: served weight version), set by the engine fleet before the first :meth:`apply`; ``None`` on the trainer side
    engines: Engines | None = None

    def __init__(self, config: RunConfig) -> None:
        self.run_config = config
        self.config = config.weight_sync

    @abstractmethod
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightUpdate:
        """Publish ``named_tensors`` (HF names, CPU tensors) as ``version``."""

    def push_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int) -> WeightUpdate:
        """Publish a LoRA adapter (PEFT's tensor names and ``adapter_config.json`` content) as ``version``; the
        update's payload has ``"lora": True``, and :meth:`apply` loads it as the adapter named
        ``payload["adapter"]`` (set by the rollout manager). Only strategies with ``CARRIES_LORA``.

        :raises NotImplementedError: this strategy cannot carry an adapter.
        """
        raise NotImplementedError(f"--weight-sync {self.NAME} cannot carry a LoRA adapter")

    @abstractmethod
    def apply(self, engine: Any, update: WeightUpdate, timeout_s: float) -> None:
        """Load ``update`` into ``engine`` (a paused :class:`vime_core.engines.engine.VLLMServer`).

        :raises TimeoutError: if the engine does not finish within ``timeout_s`` seconds.
        """

    def apply_all(self, engines: list[Any], update: WeightUpdate, timeout_s: float) -> None:
        """Load ``update`` into every (paused) engine; the rollout manager calls this.

        Default: :meth:`apply` engine by engine. Strategies whose transfer is one collective over all engines
        (``nccl``) override it to reach every engine at once.

        :raises TimeoutError: if an engine does not finish within ``timeout_s`` seconds.
        """
        for engine in engines:
            self.apply(engine, update, timeout_s)

    def unload_adapter(self, engine: Any, update: WeightUpdate) -> None:  # noqa: B027 - optional hook
        """Free what ``engine`` holds of ``update``'s adapter once it no longer serves it (default: nothing; the
        in-memory strategies drop the worker's staged tensors)."""

    @abstractmethod
    def read(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Decode ``update`` back into tensors, exactly as the engine side sees them."""

    def cleanup(self, update: WeightUpdate) -> None:  # noqa: B027 - optional hook
        """Remove what ``update`` left behind once every engine has applied it (default: nothing)."""
