"""Images in prompt data: found in a row, loaded, checked and normalised before anything expensive starts.

A row's images come from image parts of its chat messages (OpenAI-style ``{"type": "image_url", "image_url":
{"url": ...}}`` or ``{"type": "image", "image": ...}``) and/or from an images column (``--image-key``) that fills the
prompt's data-less placeholders (``{"type": "image"}`` parts, or ``<image>`` markers in a string prompt) in order.
An image is a path (relative to the data file's directory), a ``data:`` URI, bytes (parquet), or a ``{"bytes",
"path"}`` struct (a Hugging Face datasets ``Image`` column). Every image is decoded here and normalised to an RGB PNG
``data:`` URI, the form it travels in (to the engines, the trainer, checkpoints); the prompt keeps a bare
``{"type": "image"}`` part where each image stands. Formats and rules: docs/vlm.md, "Data".
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

#: a placeholder for one image in a string prompt (geo3k's convention), replaced by an image part
IMAGE_MARKER = "<image>"
DATA_URI_PREFIX = "data:image/png;base64,"
#: message part types that carry an image
IMAGE_PART_TYPES = ("image", "image_url")


class ImageDataError(ValueError):
    """An image in the prompt data that cannot be used; the message names the row, the field and what is wrong."""


def image_bytes(ref: Any, base_dir: Path) -> bytes:
    """The encoded image bytes a reference stands for.

    :param ref: a ``data:`` URI, a path (absolute, ``file://``, or relative to ``base_dir``), bytes, or a
        ``{"bytes": ..., "path": ...}`` dict (bytes win when both are set).
    :param base_dir: the data file's directory.
    :raises ImageDataError: naming the file that is missing or unreadable, a malformed ``data:`` URI, a remote URL
        (never fetched), or a reference of another type.
    """
    if isinstance(ref, dict) and ("bytes" in ref or "path" in ref):
        if ref.get("bytes") is not None:
            return image_bytes(ref["bytes"], base_dir)
        if ref.get("path"):
            return image_bytes(ref["path"], base_dir)
        raise ImageDataError("an image struct with neither 'bytes' nor 'path'")
    if isinstance(ref, bytes | bytearray | memoryview):
        return bytes(ref)
    if not isinstance(ref, str) or not ref:
        raise ImageDataError(
            f"expected an image path, a data: URI, bytes or a {{'bytes', 'path'}} struct, got {type(ref).__name__}"
        )
    if ref.startswith("data:"):
        header, sep, payload = ref.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageDataError(f"a data: URI must be 'data:<mime>;base64,<data>', got {ref[:60]!r}")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageDataError(f"a data: URI whose base64 does not decode ({e})") from None
    if ref.startswith(("http://", "https://")):
        raise ImageDataError(f"remote image {ref[:120]!r}: vime reads no URL; download it and give its path")
    path = Path(ref[len("file://") :] if ref.startswith("file://") else ref)
    if not path.is_absolute():
        path = base_dir / path
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageDataError(
            f"image file not found: {path} (relative paths are read from the data file's directory)"
        ) from None
    except OSError as e:
        raise ImageDataError(f"cannot read image file {path} ({e.strerror or e})") from None


def normalise(data: bytes) -> str:
    """Decode an encoded image and return it as an RGB PNG ``data:`` URI (transparency composited on white, as
    transformers' and vLLM's image loaders do), so the engine and the trainer decode the very same pixels.

    :raises ImageDataError: if the bytes are not an image PIL can decode.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = to_rgb(img)
    except UnidentifiedImageError:
        raise ImageDataError(f"not a readable image (PIL knows no image format of these {len(data)} bytes)") from None
    except (OSError, ValueError) as e:  # a truncated or corrupt file of a known format
        raise ImageDataError(f"not a readable image ({e})") from None
    out = io.BytesIO()
    rgb.save(out, format="PNG")
    return DATA_URI_PREFIX + base64.b64encode(out.getvalue()).decode("ascii")


def to_rgb(img: Any) -> Any:
    """``img`` (a PIL image) in RGB mode, transparent pixels composited on white."""
    from PIL import Image

    if img.mode == "RGB":
        return img.copy()
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(uri: str) -> Any:
    """The RGB PIL image of a normalised ``data:`` URI (:func:`normalise`).

    :raises ImageDataError: if ``uri`` is not a decodable image ``data:`` URI.
    """
    from PIL import Image

    with Image.open(io.BytesIO(image_bytes(uri, Path(".")))) as img:
        img.load()
        return to_rgb(img)


def load_image(ref: Any, base_dir: Path) -> str:
    """:func:`image_bytes` then :func:`normalise`: the reference as an RGB PNG ``data:`` URI."""
    return normalise(image_bytes(ref, base_dir))


def part_image(part: dict[str, Any]) -> tuple[bool, Any]:
    """``(is an image part, its inline reference or None)`` of one message content part."""
    kind = part.get("type")
    if kind == "image_url" or (kind is None and "image_url" in part):
        url = part.get("image_url")
        return True, url.get("url") if isinstance(url, dict) else url
    if kind == "image" or (kind is None and "image" in part):
        return True, part.get("image")
    return False, None


def count_image_parts(prompt: str | list[dict[str, Any]]) -> int:
    """How many image parts the prompt's messages hold (0 for a string prompt)."""
    if isinstance(prompt, str):
        return 0
    return sum(
        part_image(p)[0]
        for m in prompt
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict)
    )


def prompt_with_images(
    prompt: str | list[dict[str, Any]],
    column: list[Any] | None,
    base_dir: Path,
    where: str,
    input_key: str,
    image_key: str | None,
) -> tuple[str | list[dict[str, Any]], list[str]]:
    """Find, load and place a row's images.

    Inline images (in message parts) are loaded where they are; the ``column`` images (``--image-key``) fill the
    data-less placeholders in order: ``{"type": "image"}`` parts of the messages, or ``<image>`` markers of a string
    prompt; a string prompt without markers gets them as image parts before its text, in one user message.

    :param prompt: the row's ``--input-key`` value (a string or chat messages, already checked by ``read_rows``).
    :param column: the row's ``--image-key`` value (a list, or one image), ``None`` without ``--image-key``.
    :param where: ``FILE:line N`` / ``FILE:row N`` for messages.
    :return: ``(prompt, images)``: the prompt with every image part a bare ``{"type": "image"}`` (a string prompt
        with images becomes one user message), and the images as RGB PNG ``data:`` URIs in placeholder order. A row
        without images is returned as it is, with ``[]``.
    :raises ImageDataError: naming ``where``, the field and the image's index: an image that is missing or
        unreadable, a part type that is not text or image, more column images than placeholders or fewer.
    """
    if column is not None and not isinstance(column, list):
        column = [column]
    column = list(column or [])

    def load(ref: Any, field: str) -> str:
        try:
            return load_image(ref, base_dir)
        except ImageDataError as e:
            raise ImageDataError(f"{where}: {field}: {e}") from None

    if isinstance(prompt, str):
        if not column:
            return prompt, []
        pieces = prompt.split(IMAGE_MARKER)
        markers = len(pieces) - 1
        if markers and markers != len(column):
            more = "more" if len(column) > markers else "fewer"
            raise ImageDataError(
                f"{where}: {more} images in {image_key!r} ({len(column)}) than {IMAGE_MARKER} placeholders in "
                f"{input_key!r} ({markers})"
            )
        images = [load(ref, f"{image_key!r} image {i}") for i, ref in enumerate(column)]
        parts: list[dict[str, Any]] = []
        if markers:
            for i, text in enumerate(pieces):
                if text:
                    parts.append({"type": "text", "text": text})
                if i < markers:
                    parts.append({"type": "image"})
        else:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        return [{"role": "user", "content": parts}], images

    images: list[str] = []
    used = 0
    out_messages = []
    for mi, message in enumerate(prompt):
        content = message.get("content")
        if not isinstance(content, list):
            out_messages.append(message)
            continue
        new_content = []
        for pi, part in enumerate(content):
            field = f"{input_key!r} message {mi} part {pi}"
            if not isinstance(part, dict):
                raise ImageDataError(f"{where}: {field}: a content part must be an object, got {part!r:.80}")
            is_image, ref = part_image(part)
            if not is_image:
                if part.get("type", "text") != "text":
                    raise ImageDataError(
                        f"{where}: {field}: part type {part.get('type')!r} is not supported (text and image parts are)"
                    )
                new_content.append(part)
                continue
            if ref is None:
                if used >= len(column):
                    source = f"{image_key!r} has {len(column)}" if image_key else "no --image-key column is given"
                    raise ImageDataError(
                        f"{where}: {field}: an image placeholder without an image ({source}; the placeholders "
                        f"need {count_image_parts(prompt)})"
                    )
                images.append(load(column[used], f"{image_key!r} image {used}"))
                used += 1
            else:
                images.append(load(ref, field))
            new_content.append({"type": "image"})
        out_messages.append({**message, "content": new_content})
    if used < len(column):
        raise ImageDataError(
            f"{where}: more images in {image_key!r} ({len(column)}) than image placeholders in {input_key!r} ({used})"
        )
    return (out_messages if images else prompt), images
