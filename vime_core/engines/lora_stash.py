"""Engine side of in-memory LoRA adapter sync (``ipc``, ``nccl``): adapters whose tensors arrived by handle or
broadcast, served through vLLM's own runtime LoRA API without their weights ever touching a disk.

A worker stages an adapter's tensors under a directory that holds only its ``adapter_config.json``; the engine then
loads that directory as usual (``POST /v1/load_lora_adapter``), and vLLM's loader, which reads the config from the
directory, takes the tensors from the stash instead of ``adapter_model.safetensors`` (the approach of verl's
``TensorLoRARequest``; here the worker's LoRA manager gets a subclass of its own LoRA model class, nothing global is
patched). docs/lora.md.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

#: the keyword arguments of vLLM's ``LoRAModel.from_local_checkpoint`` handed on to ``from_lora_tensors`` (vLLM 0.24
#: and 0.32 name them alike; the others — ``moe_ep_spec``, ``tensorizer_config_dict`` — concern files)
PASSED_ON = ("device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes")


def stage_dir(key: str) -> Path:
    """Where a worker stages the adapter ``key`` (``<engine>/<adapter name>``): under this process's temporary
    directory, the same for every worker of one engine (they share a node and an environment)."""
    return Path(tempfile.gettempdir()) / "vime-lora" / key


class AdapterStash:
    """The adapters one worker holds in host memory, by the real path of their staging directory.

    :meth:`install` makes the worker's LoRA manager load a staged directory from here; any other directory (an
    adapter on disk: ``--lora-adapter-path``, a replacement engine's host copies) loads from its files as before.
    """

    def __init__(self) -> None:
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}

    def install(self, lora_manager: Any) -> None:
        """Give ``lora_manager`` (vLLM's ``LRUCacheWorkerLoRAManager``) a LoRA model class that reads staged
        adapters from this stash (once per manager).

        :raises RuntimeError: the engine serves no LoRA (started without ``--enable-lora``).
        """
        if lora_manager is None:
            raise RuntimeError("this engine serves no LoRA adapters (started without --enable-lora)")
        base = lora_manager._lora_model_cls
        if getattr(base, "vime_stash", None) is self:
            return
        stash = self
        accepted = set(inspect.signature(base.from_lora_tensors).parameters)

        class StashedLoRAModel(base):  # type: ignore[misc, valid-type]
            vime_stash = stash

            @classmethod
            def from_local_checkpoint(cls, lora_dir: str, expected_lora_modules: Any, peft_helper: Any, **kw: Any):
                tensors = stash.adapters.get(os.path.realpath(lora_dir))
                if tensors is None:
                    return super().from_local_checkpoint(lora_dir, expected_lora_modules, peft_helper, **kw)
                if kw.get("lora_model_id") is None:
                    raise ValueError(f"{lora_dir}: a staged adapter needs the request's lora_int_id")
                passed = {k: kw[k] for k in PASSED_ON if k in kw and k in accepted}
                return cls.from_lora_tensors(
                    lora_model_id=kw["lora_model_id"], tensors=dict(tensors), peft_helper=peft_helper, **passed
                )

        lora_manager._lora_model_cls = StashedLoRAModel

    def stage(self, key: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
        """Keep ``tensors`` (host copies, PEFT names) and write ``adapter_config.json`` (``config``) into
        :func:`stage_dir` ``(key)`` (atomically: the workers of one engine write the same file).

        :return: the staging directory, what ``/v1/load_lora_adapter`` is given.
        :raises ValueError: ``config`` is not a LoRA adapter's (``peft_type`` ``LORA``) or ``tensors`` is empty.
        """
        if config.get("peft_type") != "LORA":
            raise ValueError(f"adapter {key}: adapter_config has peft_type {config.get('peft_type')!r}, not 'LORA'")
        if not tensors:
            raise ValueError(f"adapter {key}: no tensors arrived")
        path = stage_dir(key)
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".adapter_config.")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        os.replace(tmp, path / "adapter_config.json")
        self.adapters[os.path.realpath(path)] = tensors
        return path

    def drop(self, key: str) -> bool:
        """Forget the adapter ``key`` and remove its staging directory. :return: whether it was staged."""
        path = stage_dir(key)
        gone = self.adapters.pop(os.path.realpath(path), None)
        (path / "adapter_config.json").unlink(missing_ok=True)
        try:
            path.rmdir()
        except OSError:
            pass
        return gone is not None
