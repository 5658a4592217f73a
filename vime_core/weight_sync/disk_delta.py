"""``disk-delta`` weight sync: per version, only the bytes that changed since the engines' current version.

The trainer side (:class:`DiskDeltaWeightSync`) compares each pushed tensor with a host snapshot of the engines'
weights and writes the changed ones encoded (``xor``, ``sub``, ``overwrite`` or ``full``), zstd-compressed and
checksummed, to ``weight_v{N:06d}/delta.safetensors``; :class:`DeltaReceiver` decodes and verifies a version in
each vLLM worker before it applies it. Encodings, the on-disk format and the engine side: docs/weight_sync.md,
"disk-delta".
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vime_core.config import RunConfig
from vime_core.models import resolve_model
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate, call_with_timeout, write_version_dir
from vime_core.weight_sync.tensor_io import checksum, dtype_name, safetensors_files, tensor_bytes, tensor_from_bytes

logger = logging.getLogger("vime.weight_sync")

FORMAT = "vime-disk-delta"
FORMAT_VERSION = 1
DELTA_FILE = "delta.safetensors"
MANIFEST_KEY = "vime_delta"
ENCODINGS = ("xor", "sub", "overwrite")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _zigzag_sub(old: np.ndarray, new: np.ndarray, itemsize: int) -> np.ndarray:
    """``zigzag(new - old)`` per element (unsigned, wrapping), as bytes."""
    u = _UINT[itemsize]
    d = new.view(u) - old.view(u)  # wraps modulo 2**bits
    sign = (d >> u(8 * itemsize - 1)) * u(np.iinfo(u).max)  # all ones where d is negative as a signed integer
    return ((d << u(1)) ^ sign).view(np.uint8)


def _unzigzag_add(old: np.ndarray, z: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of :func:`_zigzag_sub`: ``old + unzigzag(z)`` as bytes."""
    u = _UINT[itemsize]
    zz = z.view(u)
    d = (zz >> u(1)) ^ ((zz & u(1)) * u(np.iinfo(u).max))
    return (old.view(u) + d).view(np.uint8)


CHECKSUM = "xxh3-128"


class DeltaSyncError(RuntimeError):
    """A delta could not be applied (unreadable file, bad manifest, missing base tensor); state is unchanged."""


class DeltaVersionError(DeltaSyncError):
    """The delta's base version is not the receiver's current version (out of order, or the base is unknown)."""


class DeltaChecksumError(DeltaSyncError):
    """A decoded tensor's xxh3-128 digest differs from the manifest (corrupt or truncated payload, wrong base)."""


# ------------------------------------------------------------------------------------------------- byte codecs
def _shuffle(buf: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-shuffle ``buf`` (length a multiple of ``itemsize``): byte 0 of every element, then byte 1, ..."""
    if itemsize <= 1 or buf.size % itemsize:
        return buf
    return np.ascontiguousarray(buf.reshape(-1, itemsize).T).reshape(-1)


def _unshuffle(buf: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize <= 1 or buf.size % itemsize:
        return buf
    return np.ascontiguousarray(buf.reshape(itemsize, -1).T).reshape(-1)


def _compress(buf: np.ndarray, level: int) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(memoryview(np.ascontiguousarray(buf)))


def _decompress(payload: bytes | np.ndarray, expected_size: int) -> np.ndarray:
    import zstandard

    data = zstandard.ZstdDecompressor().decompress(
        memoryview(np.ascontiguousarray(payload)) if isinstance(payload, np.ndarray) else payload,
        max_output_size=max(expected_size, 1),
    )
    return np.frombuffer(data, dtype=np.uint8)


def encode(
    old: np.ndarray | None, new: np.ndarray, itemsize: int, encoding: str, level: int = 1
) -> tuple[str, bytes | None, int]:
    """Encode one tensor's change.

    :param old: base bytes (``uint8`` 1-D), or ``None`` when the base has no such tensor (or another dtype/shape).
    :param new: new bytes (``uint8`` 1-D).
    :param itemsize: element size in bytes (the shuffle stride).
    :param encoding: ``"xor"``, ``"sub"`` or ``"overwrite"``.
    :param level: zstd level.
    :return: ``(kind, compressed payload or None, changed bytes)``; kind ``"same"`` (no payload) when unchanged.
    :raises ValueError: on an unknown encoding.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown delta encoding {encoding!r}; choose one of {ENCODINGS}")
    if old is None or old.size != new.size:
        return "full", _compress(_shuffle(new, itemsize), level), int(new.size)
    if encoding in ("xor", "sub"):
        diff = np.bitwise_xor(old, new)
        changed = int(np.count_nonzero(diff))
        if not changed:
            return "same", None, 0
        if encoding == "sub" and itemsize in _UINT and new.size % itemsize == 0:
            return "sub", _compress(_shuffle(_zigzag_sub(old, new, itemsize), itemsize), level), changed
        return "xor", _compress(_shuffle(diff, itemsize), level), changed
    mask = old != new
    pos = np.flatnonzero(mask)
    if not pos.size:
        return "same", None, 0
    width = 4 if new.size < 2**32 else 8
    gaps = np.diff(pos, prepend=0).astype(f"<u{width}")
    header = np.array([pos.size, width], dtype="<u8").view(np.uint8)
    body = np.concatenate([header, _shuffle(gaps.view(np.uint8), width), new[pos]])
    return "overwrite", _compress(body, level), int(pos.size)


def decode(old: np.ndarray | None, kind: str, payload: bytes | np.ndarray, nbytes: int, itemsize: int) -> np.ndarray:
    """Inverse of :func:`encode` (``kind`` other than ``"same"``): the new bytes, ``uint8`` 1-D of ``nbytes``.

    :raises DeltaSyncError: if the payload does not decompress, has the wrong size, or needs a base that is missing.
    """
    import zstandard

    try:
        if kind == "full":
            out = _unshuffle(_decompress(payload, nbytes), itemsize)
        elif old is None or old.size != nbytes:
            raise DeltaSyncError(
                f"a {kind!r} delta needs a base tensor of {nbytes} bytes, the base has "
                f"{None if old is None else old.size}"
            )
        elif kind == "xor":
            out = np.bitwise_xor(old, _unshuffle(_decompress(payload, nbytes), itemsize))
        elif kind == "sub":
            z = _unshuffle(_decompress(payload, nbytes), itemsize)
            if z.size != nbytes or itemsize not in _UINT:
                raise DeltaChecksumError(f"sub payload decodes to {z.size} bytes, expected {nbytes}")
            out = _unzigzag_add(old, z, itemsize)
        elif kind == "overwrite":
            body = _decompress(payload, 16 + nbytes * 9)
            count, width = (int(x) for x in body[:16].view("<u8"))
            if width not in (4, 8) or 16 + count * (width + 1) != body.size:
                raise DeltaSyncError(f"malformed overwrite payload (count {count}, width {width}, {body.size} bytes)")
            gaps = _unshuffle(body[16 : 16 + count * width], width).view(f"<u{width}")
            pos = np.cumsum(gaps, dtype=np.uint64).astype(np.int64)
            if count and (pos[-1] >= nbytes):
                raise DeltaSyncError(f"overwrite position {int(pos[-1])} outside a tensor of {nbytes} bytes")
            out = old.copy()
            out[pos] = body[16 + count * width :]
        else:
            raise DeltaSyncError(f"unknown delta kind {kind!r}")
    except zstandard.ZstdError as e:
        raise DeltaChecksumError(f"corrupt {kind} payload (zstd: {e})") from e
    if out.size != nbytes:
        raise DeltaChecksumError(f"{kind} payload decodes to {out.size} bytes, expected {nbytes}")
    return out


# -------------------------------------------------------------------------------------------------- base reader
class BaseDirReader:
    """Reads seed tensors from an HF model directory (its ``*.safetensors`` files), cast to a requested dtype.

    Both sides seed from the same directory with the same cast (``Tensor.to``, round-to-nearest-even), so the
    trainer's and the engine's base bytes agree; the checksums catch it when they do not.

    :param path: HF model directory (or ``None``: an empty base, every tensor travels as ``full`` once).
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._index: dict[str, Path] | None = None

    def _files(self) -> dict[str, Path]:
        if self._index is None:
            self._index = {}
            if self.path is not None:
                from safetensors import safe_open

                for f in safetensors_files(self.path):
                    with safe_open(str(f), framework="pt", device="cpu") as st:
                        for name in st.keys():
                            self._index[name] = f
        return self._index

    def tensor(self, name: str) -> torch.Tensor | None:
        """``name`` as stored (its file's dtype), or ``None`` if absent."""
        f = self._files().get(name)
        if f is None:
            return None
        from safetensors import safe_open

        with safe_open(str(f), framework="pt", device="cpu") as st:
            return st.get_tensor(name)

    def read(self, name: str, dtype: str, shape: list[int]) -> np.ndarray | None:
        """The bytes of ``name`` cast to ``dtype``, or ``None`` if absent or of another shape."""
        t = self.tensor(name)
        if t is None or list(t.shape) != list(shape):
            return None
        return tensor_bytes(t.to(getattr(torch, dtype)))


# ----------------------------------------------------------------------------------------------------- manifest
def read_delta(path: str | Path) -> tuple[dict[str, Any], Any]:
    """Open ``path/delta.safetensors``: ``(manifest, safe_open handle)`` (numpy framework).

    :raises DeltaSyncError: if the file is missing, unreadable (truncated) or not a vime delta.
    """
    from safetensors import safe_open

    f = Path(path) / DELTA_FILE
    try:
        handle = safe_open(str(f), framework="numpy")
        meta = handle.metadata() or {}
        manifest = json.loads(meta[MANIFEST_KEY])
    except FileNotFoundError as e:
        raise DeltaSyncError(f"no delta file at {f}") from e
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type; all mean "unreadable"
        raise DeltaSyncError(f"unreadable delta file {f}: {type(e).__name__}: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise DeltaSyncError(f"{f} is not a {FORMAT} v{FORMAT_VERSION} file: {manifest.get('format')!r}")
    return manifest, handle


def group_key(name: str) -> str:
    """The reload group of an HF tensor name: the decoder layer (``model.layers.N``), the vision block of a
    vision-language model (``visual.blocks.N``), or else its module.

    vLLM fuses q/k/v and gate/up into one layer, and its in-place reload keeps old values only for layers that get
    no tensor at all: a layer that gets some of its tensors is rebuilt from those alone. Reloading every tensor of a
    touched decoder layer (and any other touched module whole) keeps every fused layer complete.
    """
    m = re.match(r"^(.*?\.(?:layers|blocks)\.\d+)\.", name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


@dataclass
class PreparedDelta:
    """A decoded and verified version, not yet applied: what :meth:`DeltaReceiver.commit` installs."""

    version: int
    base_version: int | None
    manifest: dict[str, Any]
    new: dict[str, np.ndarray] = field(default_factory=dict)  # changed tensors' new bytes
    already_applied: bool = False
    seconds: float = 0.0

    @property
    def changed(self) -> list[str]:
        return sorted(self.new)


class DeltaReceiver:
    """Engine-side state: the current version and the HF tensors it corresponds to (as host bytes).

    Also the worker's record of the weights it serves (:meth:`current_tensor`), which completes a partial load of
    a fused vLLM layer (see :meth:`vime_core.engines.worker_extension.VimeWorkerExtension.vime_load_weights`).

    :param base_dir: directory the engine loaded (seed of tensors not yet in the snapshot), or ``None`` (the
        engine's weights are unknown).
    :param version: the version of those weights (0 = the initial model); ``None`` = unknown (deltas refused).
    """

    def __init__(self, base_dir: str | Path | None, version: int | None = 0) -> None:
        self.reset(base_dir, version)
        self.lock = threading.Lock()

    def reset(self, base_dir: str | Path | None, version: int | None) -> None:
        """Forget the snapshot: the engine now holds the full checkpoint ``base_dir`` as ``version``."""
        self.base = BaseDirReader(base_dir)
        self.version = version
        self.snapshot: dict[str, np.ndarray] = {}
        self.layout: dict[str, tuple[str, list[int]]] = {}  # dtype name and shape of each snapshot entry

    @property
    def weights_known(self) -> bool:
        """Whether every tensor the engine serves can be read back (:meth:`current_tensor`)."""
        return self.base.path is not None

    def _current(self, name: str, info: dict[str, Any]) -> np.ndarray | None:
        buf = self.snapshot.get(name)
        if buf is None:
            buf = self.base.read(name, info["dtype"], info["shape"])
            if buf is not None:
                self.snapshot[name] = buf
                self.layout[name] = (info["dtype"], list(info["shape"]))
        return buf

    def current_tensor(self, name: str) -> torch.Tensor | None:
        """The HF tensor ``name`` as the engine serves it now, or ``None`` if unknown."""
        if not self.weights_known:
            return None
        if name in self.snapshot and name in self.layout:
            dtype, shape = self.layout[name]
            return tensor_from_bytes(self.snapshot[name], dtype, shape)
        return self.base.tensor(name)

    def record(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        """The engine loaded ``tensors`` on top of what it served (a partial load): they replace those names, and
        the weights are now ``version`` (``None``: unknown, deltas refused until a versioned full load)."""
        for name, t in tensors.items():
            self.snapshot[name] = tensor_bytes(t)
            self.layout[name] = (dtype_name(t.dtype), list(t.shape))
        self.version = version

    def prepare(
        self, path: str | Path, base_version: int | None = None, new_version: int | None = None
    ) -> PreparedDelta:
        """Decode and verify the version at ``path`` without changing any state.

        :param path: a ``weight_v{N:06d}`` directory.
        :param base_version: expected base version (checked against the manifest when given).
        :param new_version: expected new version (checked against the manifest when given).
        :return: the decoded version (``already_applied`` when the receiver is on it already, checksums equal).
        :raises DeltaVersionError: if the base is not the receiver's current version.
        :raises DeltaChecksumError: if any tensor's digest differs (the whole version is refused).
        :raises DeltaSyncError: if the file cannot be read or does not match the expected versions.
        """
        t0 = time.perf_counter()
        manifest, handle = read_delta(path)
        version, base = int(manifest["version"]), manifest.get("base_version")
        if new_version is not None and int(new_version) != version:
            raise DeltaSyncError(f"{path} holds version {version}, asked to apply version {new_version}")
        if base_version is not None and base is not None and int(base_version) != int(base):
            raise DeltaSyncError(f"{path} is based on version {base}, asked to apply it on {base_version}")
        prepared = PreparedDelta(version, base, manifest)
        tensors = manifest["tensors"]
        if self.version == version:  # a retry of a version that was applied: verify, do not apply twice
            for name, info in tensors.items():
                cur = self._current(name, info)
                if cur is None or checksum(cur) != info["checksum"]:
                    raise DeltaChecksumError(f"receiver claims version {version} but {name} differs from it")
            prepared.already_applied = True
            prepared.seconds = time.perf_counter() - t0
            return prepared
        if self.version is None:
            raise DeltaVersionError(
                f"refusing delta {base} -> {version}: the engine's weights were replaced without a version "
                "(load a full checkpoint with a version first)"
            )
        if base is None or int(base) != self.version:
            raise DeltaVersionError(
                f"refusing out-of-order delta {base} -> {version}: the engine holds version {self.version}"
            )
        payload_names = set(handle.keys())
        for name, info in tensors.items():
            itemsize = torch.empty((), dtype=getattr(torch, info["dtype"])).element_size()
            kind = info["kind"]
            cur = self._current(name, info)
            if kind == "same":
                if cur is None or checksum(cur) != info["checksum"]:
                    raise DeltaChecksumError(
                        f"{name}: the engine's base differs from the trainer's (unchanged "
                        f"tensor, checksum mismatch; base version {self.version})"
                    )
                continue
            if name not in payload_names:
                raise DeltaSyncError(f"{name}: manifest says {kind!r} but the file has no payload for it")
            try:
                new = decode(cur, kind, handle.get_tensor(name), int(info["nbytes"]), itemsize)
            except DeltaSyncError as e:
                raise type(e)(f"{name}: {e}") from e
            if checksum(new) != info["checksum"]:
                raise DeltaChecksumError(
                    f"{name}: checksum mismatch after applying the {kind} delta "
                    f"{base} -> {version} (corrupt file or wrong base)"
                )
            prepared.new[name] = new
        prepared.seconds = time.perf_counter() - t0
        return prepared

    def load_set(self, prepared: PreparedDelta) -> list[str]:
        """Names to reload into the model for ``prepared``: every tensor of each reload group that changed."""
        groups = {group_key(n) for n in prepared.new}
        return [n for n in prepared.manifest["tensors"] if group_key(n) in groups]

    def tensor(self, prepared: PreparedDelta, name: str) -> torch.Tensor:
        """The tensor ``name`` as of ``prepared``'s version (new bytes if it changed, else the current ones)."""
        info = prepared.manifest["tensors"][name]
        buf = prepared.new.get(name)
        if buf is None:
            buf = self._current(name, info)
        if buf is None:
            raise DeltaSyncError(f"{name}: not in the engine's base")
        return tensor_from_bytes(buf, info["dtype"], info["shape"])

    def iter_tensors(self, prepared: PreparedDelta, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for ``names`` as of ``prepared``'s version."""
        for name in names:
            yield name, self.tensor(prepared, name)

    def commit(self, prepared: PreparedDelta) -> None:
        """Move the snapshot and the version to ``prepared`` (call after the model was loaded)."""
        self.snapshot.update(prepared.new)
        for name in prepared.new:
            info = prepared.manifest["tensors"][name]
            self.layout[name] = (info["dtype"], list(info["shape"]))
        self.version = prepared.version


# -------------------------------------------------------------------------------------------------- the strategy
class DiskDeltaWeightSync(WeightSyncStrategy):
    """Trainer side writes ``weight_v{N:06d}/delta.safetensors`` (see the module docstring); each engine applies it
    through ``/collective_rpc vime_apply_delta`` (decode + verify everything, then reload the touched layers).

    Flags (its :class:`~vime_core.config.WeightSyncConfig`): ``--update-weight-disk-dir`` (where versions are
    written), ``--keep-weight-updates``, ``--update-weight-delta-encoding`` (``sub``, ``xor`` or ``overwrite``),
    ``--update-weight-delta-zstd-level``, ``--update-weight-delta-base`` (seed directory; default the ``--model``
    directory; none: the first version carries every tensor in full).

    :ivar version: the version the trainer-side snapshot holds (the engines' version once an update is applied).
    """

    NAME = "disk-delta"

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.encoding = self.config.update_weight_delta_encoding
        if self.encoding not in ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        self.level = int(self.config.update_weight_delta_zstd_level)
        self._base = BaseDirReader(self._base_dir())
        self.snapshot: dict[str, np.ndarray] = {}
        self.version = 0
        self._reader: DeltaReceiver | None = None  # for read(): the engine side without an engine

    def _base_dir(self) -> Path | None:
        base = self.config.update_weight_delta_base
        if base:
            return Path(base)
        model = self.config.model
        if model:
            return resolve_model(model)
        return None

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Make ``named_tensors`` the snapshot of ``version`` (what the engines hold now), replacing the seed dir."""
        self.snapshot = {name: tensor_bytes(t) for name, t in named_tensors}
        self._base = BaseDirReader(None)
        self.version = version

    def _dir(self, version: int) -> Path:
        return Path(self.config.update_weight_disk_dir) / f"weight_v{version:06d}"

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightUpdate:
        """Diff ``named_tensors`` against the snapshot, write the delta of ``self.version → version``.

        :return: update with ``num_bytes`` = bytes written, ``seconds`` = encode + write time, and ``payload``
            ``{"path", "base_version", "version", "full_bytes", "changed_bytes", "changed_tensors", "tensors"}``.
        :raises ValueError: if ``version`` is not above the snapshot's version.
        :raises WeightWriteError: the directory cannot be written (full, read-only), naming it; the snapshot stays
            at the engines' version.
        """
        from safetensors.numpy import save_file

        t0 = time.perf_counter()
        if version <= self.version:
            raise ValueError(f"disk-delta: new version {version} must be above the snapshot's {self.version}")
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": version,
            "base_version": self.version,
            "encoding": self.encoding,
            "compression": "zstd",
            "checksum": CHECKSUM,
            "tensors": {},
        }
        payloads: dict[str, np.ndarray] = {}
        new_snapshot: dict[str, np.ndarray] = {}
        full_bytes = changed_bytes = 0
        for name, t in named_tensors:
            new = tensor_bytes(t)
            dtype, shape = dtype_name(t.dtype), list(t.shape)
            old = self.snapshot.get(name)
            if old is None:
                old = self._base.read(name, dtype, shape)
            kind, payload, changed = encode(old, new, t.element_size(), self.encoding, self.level)
            manifest["tensors"][name] = {
                "dtype": dtype,
                "shape": shape,
                "nbytes": int(new.size),
                "checksum": checksum(new),
                "kind": kind,
                "changed_bytes": changed,
            }
            if payload is not None:
                payloads[name] = np.frombuffer(payload, dtype=np.uint8)
            new_snapshot[name] = new
            full_bytes += int(new.size)
            changed_bytes += changed
        out = self._dir(version)
        write_version_dir(  # atomic: an engine never sees a half-written version; on failure the snapshot stays
            out, lambda tmp: save_file(payloads, str(tmp / DELTA_FILE), metadata={MANIFEST_KEY: json.dumps(manifest)})
        )
        base_version = self.version
        self.snapshot.update(new_snapshot)  # the engines' version once they apply it
        self.version = version
        nbytes = (out / DELTA_FILE).stat().st_size
        payload_info = {
            "path": str(out),
            "base_version": base_version,
            "version": version,
            "full_bytes": full_bytes,
            "changed_bytes": changed_bytes,
            "changed_tensors": len(payloads),
            "tensors": len(manifest["tensors"]),
        }
        seconds = time.perf_counter() - t0
        logger.info(
            "disk-delta v%d (base v%d): %d/%d tensors changed, %d bytes written for %d (%.1f%%), %.2f s",
            version,
            base_version,
            len(payloads),
            len(manifest["tensors"]),
            nbytes,
            full_bytes,
            100.0 * nbytes / max(full_bytes, 1),
            seconds,
        )
        return WeightUpdate(version, payload_info, num_bytes=nbytes, seconds=seconds)

    def apply(self, engine: Any, update: WeightUpdate, timeout_s: float) -> None:
        """Have every worker of ``engine`` apply ``update`` (``vime_apply_delta``), within ``timeout_s`` seconds.

        :raises TimeoutError: if the engine does not answer in time.
        :raises RuntimeError: (``VLLMServerError``) with the worker's error, e.g. a checksum or version refusal;
            the engine then still serves its previous version.
        """
        p = update.payload
        call_with_timeout(
            lambda: engine.collective_rpc("vime_apply_delta", args=[p["path"], p["base_version"], p["version"]]),
            timeout_s,
            f"disk-delta: engine {getattr(engine, 'url', engine)} applying version {p['version']}",
        )

    def read(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        """Apply ``update`` to a receiver held by this object (seeded like the engines) and return every tensor.

        :raises DeltaVersionError / DeltaChecksumError / DeltaSyncError: as :meth:`DeltaReceiver.prepare`.
        """
        if self._reader is None:
            self._reader = DeltaReceiver(self._base.path, 0)
        p = update.payload
        prepared = self._reader.prepare(p["path"], p.get("base_version"), update.version)
        tensors = dict(self._reader.iter_tensors(prepared, prepared.manifest["tensors"]))
        self._reader.commit(prepared)
        return tensors

    def cleanup(self, update: WeightUpdate) -> None:
        """Remove the version's directory unless ``--keep-weight-updates``."""
        if not self.config.keep_weight_updates:
            shutil.rmtree(update.payload["path"], ignore_errors=True)
