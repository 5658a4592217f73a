"""The data buffer: reads prompt data, hands out groups, takes back unfinished groups, saves/restores its state.

Rows come from a ``.jsonl`` or ``.parquet`` file (``--prompt-data``). Each row gives a prompt (``--input-key``;
a string or a list of chat messages), an optional label (``--label-key``), metadata (``--metadata-key``) and, for a
vision-language model, images (in the messages, or ``--image-key``: :mod:`vime_core.data.images`).
The order is a seeded permutation per epoch (``--rollout-shuffle``), so a resume neither repeats nor skips
prompts: the state is (epoch, offset, returned groups) and is saved with every checkpoint.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

from vime_core.data.images import ImageDataError, prompt_with_images
from vime_core.types import Sample, Status


class DataError(ValueError):
    """Bad prompt data; the message names the file, the line/row and what was expected."""


def read_rows(
    path: Path,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    flag: str = "--prompt-data",
    image_key: str | None = None,
) -> list[dict[str, Any]]:
    """Read and check prompt rows.

    :param flag: the flag the file came from, named in errors (``--eval-prompt-data NAME`` for an eval set).
    :param image_key: the field holding each row's images (``--image-key``; every row must have it), or ``None``.
        Images inside the messages are read either way (:func:`vime_core.data.images.prompt_with_images`).

    :return: dicts with keys ``prompt``, ``label``, ``metadata``, ``images`` (RGB PNG ``data:`` URIs, ``[]`` for a
        text row; a row with images has chat messages with a bare ``{"type": "image"}`` part per image) and
        ``where`` (``FILE:line N`` / ``FILE:row N``, for error messages).
    :raises DataError: unreadable file (missing, a directory, no permission, not UTF-8), unsupported suffix, bad
        JSON, a row without ``input_key`` (naming the line), a prompt that is neither a string nor a list of
        ``{"role", "content"}`` messages, or an empty prompt (``""``, only whitespace, or no messages); a row without
        ``image_key``, an image that is missing or unreadable, more images than placeholders or fewer.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{flag} {path}: file not found")
    if path.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"{flag} {path}: expected a .jsonl or .parquet file")
    try:
        raw = _read_raw(path)
    except OSError as e:  # a directory, no read permission, an I/O error
        raise DataError(f"{flag} {path}: cannot read the file ({e.strerror or e})") from None
    rows = []
    where = "line" if path.suffix == ".jsonl" else "row"
    for lineno, obj in raw:
        if not isinstance(obj, dict) or input_key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path}:{where} {lineno}: missing --input-key {input_key!r} (row has {keys})")
        prompt = obj[input_key]
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        ):
            raise DataError(
                f"{path}:{where} {lineno}: {input_key!r} must be a string or a list of {{'role', 'content'}} messages"
            )
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise DataError(f"{path}:{where} {lineno}: empty prompt in {input_key!r} (got {prompt!r})")
        if label_key and label_key not in obj:
            raise DataError(f"{path}:{where} {lineno}: missing --label-key {label_key!r}")
        metadata = obj.get(metadata_key) if metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            raise DataError(f"{path}:{where} {lineno}: {metadata_key!r} must be an object")
        if image_key and image_key not in obj:
            raise DataError(f"{path}:{where} {lineno}: missing --image-key {image_key!r} (row has {sorted(obj)})")
        try:
            prompt, images = prompt_with_images(
                prompt,
                obj.get(image_key) if image_key else None,
                path.parent,
                f"{path}:{where} {lineno}",
                input_key,
                image_key,
            )
        except ImageDataError as e:
            raise DataError(str(e)) from None
        rows.append(
            {
                "prompt": prompt,
                "images": images,
                "label": obj.get(label_key) if label_key else None,
                "metadata": metadata or {},
                "where": f"{path}:{where} {lineno}",
            }
        )
    if not rows:
        raise DataError(f"{flag} {path}: no rows")
    return rows


def _read_raw(path: Path) -> list[tuple[int, Any]]:
    """``(line or row number, parsed object)`` of every non-blank line of a ``.jsonl`` or row of a ``.parquet``.

    :raises DataError: a line that is not UTF-8 or not valid JSON (naming the file and the line).
    :raises OSError: the file cannot be read.
    """
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        return list(enumerate(table.to_pylist(), 1))
    raw: list[tuple[int, Any]] = []
    with path.open("rb") as f:
        for lineno, data in enumerate(f, 1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                raw.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    return raw


#: ``Sample.metadata`` key of the row a sample's prompt came from: ``"FILE:line N"`` (``.jsonl``) or
#: ``"FILE:row N"`` (``.parquet``), the ``where`` of :func:`read_rows`; errors about the row name it.
PROMPT_SOURCE_KEY = "prompt_source"


def new_group(row: dict[str, Any], group_index: int, n: int, prompt_index: int | None = None) -> list[Sample]:
    """``n`` fresh pending samples of one :func:`read_rows` row (prompt and metadata deep-copied per sample);
    ``prompt_index`` is the row's position in the prompt data (:attr:`Sample.prompt_index`); the row's
    ``where`` (when it has one) goes to ``metadata[PROMPT_SOURCE_KEY]``."""
    metadata = dict(row["metadata"])
    if row.get("where"):
        metadata[PROMPT_SOURCE_KEY] = row["where"]
    return [
        Sample(
            group_index=group_index,
            index=i,
            prompt=copy.deepcopy(row["prompt"]),
            label=row["label"],
            metadata=copy.deepcopy(metadata),
            status=Status.PENDING,
            prompt_index=prompt_index,
            images=list(row.get("images") or []),
        )
        for i in range(n)
    ]


def name_prompt_source(sample: Sample) -> None:
    """Append the row the sample's prompt came from to its failure text (``metadata["error"]``), e.g.
    ``"ValueError: ... (the row at data.jsonl:line 3)"``; a sample without :data:`PROMPT_SOURCE_KEY` (not from a
    prompt file) or without an error is left as it is."""
    where = sample.metadata.get(PROMPT_SOURCE_KEY)
    error = sample.metadata.get("error")
    if where and error and not error.endswith(f"(the row at {where})"):
        sample.metadata["error"] = f"{error} (the row at {where})"


class DataSource:
    """Prompt buffer with deterministic, resumable order.

    :param rows: from :func:`read_rows`.
    :param n_samples_per_prompt: samples per group.
    :param shuffle: permute rows each epoch with ``seed + epoch``.
    """

    def __init__(self, rows: list[dict[str, Any]], n_samples_per_prompt: int, *, shuffle: bool, seed: int) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError("--n-samples-per-prompt must be >= 1")
        self.rows = rows
        self.n = n_samples_per_prompt
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self.next_group_index = 0
        self.returned: list[list[Sample]] = []  # unfinished groups handed back (partial rollout)
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.rows)

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """The next ``num_groups`` groups of ``n_samples_per_prompt`` fresh samples (returned groups first)."""
        groups: list[list[Sample]] = []
        while self.returned and len(groups) < num_groups:
            groups.append(self.returned.pop(0))
        while len(groups) < num_groups:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            row_index = self._order[self.offset]
            self.offset += 1
            gi = self.next_group_index
            self.next_group_index += 1
            groups.append(new_group(self.rows[row_index], gi, self.n, row_index))
        return groups

    def add_groups(self, groups: list[list[Sample]]) -> None:
        """Take back unfinished groups; they are handed out again before fresh prompts."""
        self.returned.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (epoch, offset, group counter, returned groups)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
            "seed": self.seed,
            "num_rows": len(self.rows),
            "returned": [[s.to_dict() for s in g] for g in self.returned],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        :raises DataError: if the prompt data changed size since the state was saved.
        """
        if state["num_rows"] != len(self.rows):
            raise DataError(
                f"resume: the buffer was saved with {state['num_rows']} prompt rows but --prompt-data now has "
                f"{len(self.rows)}; resume needs the same data"
            )
        self.epoch = state["epoch"]
        self.offset = state["offset"]
        self.next_group_index = state["next_group_index"]
        self.seed = state["seed"]
        self._order = self._permutation(self.epoch)
        self.returned = [[Sample.from_dict(d) for d in g] for g in state["returned"]]
