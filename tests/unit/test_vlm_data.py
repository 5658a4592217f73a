"""Prompt rows with images (vime_core/data/images.py through ``read_rows``): every way an image may be given loads
to the same normalised PNG, and every bad case is one error naming the file, the row and the field, with its exact
text. The model-side checks (a text-only model, the processor's ids) are in test_vlm.py."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from vime_core.data.images import decode_image, load_image, normalise, prompt_with_images
from vime_core.data.source import DataError, new_group, read_rows
from vime_core.types import Sample

pytestmark = pytest.mark.unit


def png_bytes(w: int = 40, h: int = 30, color: str = "red", mode: str = "RGB") -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new(mode, (w, h), "white" if mode == "RGB" else (0, 0, 0, 0))
    ImageDraw.Draw(img).line((0, 0, w, h), fill=color, width=3)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(png_bytes(40, 30))
    (tmp_path / "figs" / "b.png").write_bytes(png_bytes(20, 50, "blue"))
    (tmp_path / "figs" / "broken.png").write_bytes(b"not an image at all")
    return tmp_path


def test_every_form_of_an_image_loads_to_the_same_normalised_png(data_dir):
    raw = (data_dir / "figs" / "a.png").read_bytes()
    uri = normalise(raw)
    assert uri.startswith("data:image/png;base64,")
    assert load_image("figs/a.png", data_dir) == uri  # relative to the data file's directory
    assert load_image(str(data_dir / "figs" / "a.png"), Path("/")) == uri
    assert load_image("file://" + str(data_dir / "figs" / "a.png"), Path("/")) == uri
    assert load_image(raw, data_dir) == uri  # parquet bytes
    assert load_image({"bytes": raw, "path": "ignored.png"}, data_dir) == uri  # a datasets Image struct
    assert load_image({"bytes": None, "path": "figs/a.png"}, data_dir) == uri
    assert load_image("data:image/png;base64," + base64.b64encode(raw).decode(), data_dir) == uri
    assert normalise(base64.b64decode(uri.split(",", 1)[1])) == uri  # normalising is idempotent
    img = decode_image(uri)
    assert (img.mode, img.size) == ("RGB", (40, 30))
    # transparency is composited on white, as transformers' and vLLM's loaders do
    clear = decode_image(load_image(png_bytes(4, 4, "black", mode="RGBA"), data_dir))
    assert clear.getpixel((3, 0)) == (255, 255, 255) and clear.getpixel((0, 0)) == (0, 0, 0)


def test_rows_with_images_in_messages_a_column_and_markers(data_dir):
    a = load_image("figs/a.png", data_dir)
    b = load_image("figs/b.png", data_dir)
    path = write_jsonl(
        data_dir / "train.jsonl",
        [
            # OpenAI-style inline parts
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "figs/a.png"}},
                            {"type": "text", "text": "Find x."},
                        ],
                    }
                ],
                "label": "3",
                "images": [],
            },
            # placeholders filled from the column, in order
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
                    }
                ],
                "label": "4",
                "images": ["figs/b.png", "figs/a.png"],
            },
            # geo3k's <image> marker in a string prompt
            {"messages": "<image>Find the angle.", "label": "5", "images": ["figs/a.png"]},
            # a string prompt without markers: the image goes first
            {"messages": "Find y.", "label": "6", "images": ["figs/b.png"]},
            {"messages": "text only", "label": "7", "images": []},
        ],
    )
    rows = read_rows(path, "messages", "label", None, image_key="images")
    assert [r["images"] for r in rows] == [[a], [b, a], [a], [b], []]
    assert rows[0]["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
    assert rows[2]["prompt"] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the angle."}]}
    ]
    assert rows[3]["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find y."}]}]
    assert rows[4]["prompt"] == "text only"
    group = new_group(rows[1], 0, 2)
    assert [s.images for s in group] == [[b, a], [b, a]] and group[0].images is not group[1].images
    # the images travel with the sample through checkpoints (to_dict / from_dict)
    assert Sample.from_dict(json.loads(json.dumps(group[0].to_dict()))).images == [b, a]
    assert Sample.from_dict({"prompt": "old dict without images"}).images == []


def test_parquet_image_bytes_and_structs(data_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = (data_dir / "figs" / "b.png").read_bytes()
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "problem": ["<image>What is x?", "<image>What is y?"],
            "answer": ["1", "2"],
            "images": pa.array(
                [[{"bytes": raw, "path": None}], [{"bytes": None, "path": "figs/a.png"}]], type=pa.list_(struct)
            ),
        }
    )
    path = data_dir / "train.parquet"
    pq.write_table(table, path)
    rows = read_rows(path, "problem", "answer", None, image_key="images")
    assert [r["images"] for r in rows] == [[normalise(raw)], [load_image("figs/a.png", data_dir)]]
    assert rows[1]["where"] == f"{path}:row 2"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"p": "<image>x", "images": ["figs/missing.png"]},
            "{path}:line 1: 'images' image 0: image file not found: {dir}/figs/missing.png (relative paths are read "
            "from the data file's directory)",
        ),
        (
            {"p": "<image>x", "images": ["figs/broken.png"]},
            "{path}:line 1: 'images' image 0: not a readable image (PIL knows no image format of these 19 bytes)",
        ),
        (
            {"p": "<image>x", "images": ["data:image/png;base64,@@@"]},
            "{path}:line 1: 'images' image 0: a data: URI whose base64 does not decode (Only base64 data is allowed)",
        ),
        (
            {"p": "<image>x", "images": ["https://example.com/a.png"]},
            "{path}:line 1: 'images' image 0: remote image 'https://example.com/a.png': vime reads no URL; download "
            "it and give its path",
        ),
        (
            {"p": "<image>x", "images": [42]},
            "{path}:line 1: 'images' image 0: expected an image path, a data: URI, bytes or a {{'bytes', 'path'}} "
            "struct, got int",
        ),
        (
            {"p": "<image>x <image>y", "images": ["figs/a.png"]},
            "{path}:line 1: fewer images in 'images' (1) than <image> placeholders in 'p' (2)",
        ),
        (
            {"p": "<image>x", "images": ["figs/a.png", "figs/b.png"]},
            "{path}:line 1: more images in 'images' (2) than <image> placeholders in 'p' (1)",
        ),
        (
            {"p": [{"role": "user", "content": [{"type": "image"}]}], "images": ["figs/a.png", "figs/b.png"]},
            "{path}:line 1: more images in 'images' (2) than image placeholders in 'p' (1)",
        ),
        (
            {"p": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], "images": ["figs/a.png"]},
            "{path}:line 1: 'p' message 0 part 1: an image placeholder without an image ('images' has 1; the "
            "placeholders need 2)",
        ),
        (
            {
                "p": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "figs/gone.png"}}]}],
                "images": [],
            },
            "{path}:line 1: 'p' message 0 part 0: image file not found: {dir}/figs/gone.png (relative paths are read "
            "from the data file's directory)",
        ),
        (
            {"p": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "images": []},
            "{path}:line 1: 'p' message 0 part 0: part type 'input_audio' is not supported (text and image parts are)",
        ),
        ({"p": "x"}, "{path}:line 1: missing --image-key 'images' (row has ['p'])"),
    ],
)
def test_each_bad_image_row_is_one_error_naming_file_row_and_field(data_dir, row, message):
    path = write_jsonl(data_dir / "bad.jsonl", [row])
    with pytest.raises(DataError) as err:
        read_rows(path, "p", None, None, image_key="images")
    assert str(err.value) == message.format(path=path, dir=data_dir)


def test_a_placeholder_without_an_image_column_names_the_missing_flag(data_dir):
    path = write_jsonl(
        data_dir / "bad.jsonl", [{"p": "ok"}, {"p": [{"role": "user", "content": [{"type": "image"}]}]}]
    )
    with pytest.raises(DataError) as err:
        read_rows(path, "p", None, None)
    assert str(err.value) == (
        f"{path}:line 2: 'p' message 0 part 0: an image placeholder without an image (no --image-key column is "
        "given; the placeholders need 1)"
    )


def test_prompt_with_images_leaves_text_rows_alone(data_dir):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prompt_with_images(messages, None, data_dir, "here", "p", None) == (messages, [])
    assert prompt_with_images("<image> is only text without a column", None, data_dir, "here", "p", None) == (
        "<image> is only text without a column",
        [],
    )


def test_a_fully_async_fresh_copy_keeps_the_prompts_images_only(data_dir):
    from vime_core.rollout.async_producer import fresh_copy

    a = load_image("figs/a.png", data_dir)
    b = load_image("figs/b.png", data_dir)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}]
    done = Sample(group_index=3, index=1, prompt=prompt, images=[a, b], tokens=[1, 2, 3], response_length=1)
    (fresh,) = fresh_copy([done])
    assert (fresh.images, fresh.tokens, fresh.prompt) == ([a], [], prompt)  # b came from a tool result
