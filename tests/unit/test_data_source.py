"""The data buffer: clear errors on bad input, deterministic order, exact resume."""

import json
import os
import re
from pathlib import Path

import pytest

from vime_core.data.source import DataError, DataSource, read_rows

pytestmark = pytest.mark.unit


def _write(tmp_path, lines):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_read_rows_errors_name_file_and_line(tmp_path):
    p = _write(tmp_path, ['{"prompt": "a", "label": "1"}', '{"prompt": "b"'])
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON"):
        read_rows(p, "prompt", "label", None)
    p = _write(tmp_path, ['{"prompt": "a", "label": "1"}', '{"question": "b", "label": "2"}'])
    with pytest.raises(DataError, match=r"line 2: missing --input-key 'prompt' \(row has \['label', 'question'\]\)"):
        read_rows(p, "prompt", "label", None)
    p = _write(tmp_path, ['{"prompt": [{"role": "user"}], "label": "1"}'])
    with pytest.raises(DataError, match="line 1"):
        read_rows(p, "prompt", "label", None)
    with pytest.raises(DataError, match="expected a .jsonl or .parquet"):
        read_rows(tmp_path / "x.csv", "prompt", None, None) if (tmp_path / "x.csv").write_text("a") else None


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["p0", "p1"], "label": ["0", "1"]}), path)
    rows = read_rows(path, "prompt", "label", None)
    assert [(r["prompt"], r["label"]) for r in rows] == [("p0", "0"), ("p1", "1")]


def _rows(n):
    return [{"prompt": f"p{i}", "label": str(i), "metadata": {"i": i}} for i in range(n)]


def test_groups_have_n_clones_and_consecutive_indices():
    ds = DataSource(_rows(3), 4, shuffle=False, seed=0)
    groups = ds.get_groups(2)
    assert [[(s.group_index, s.index, s.prompt) for s in g] for g in groups] == [
        [(0, i, "p0") for i in range(4)],
        [(1, i, "p1") for i in range(4)],
    ]
    # the next call wraps into a new epoch after p2
    assert [g[0].prompt for g in ds.get_groups(2)] == ["p2", "p0"]
    assert ds.epoch == 1


def test_resume_continues_exactly(tmp_path):
    a = DataSource(_rows(10), 2, shuffle=True, seed=7)
    first = [g[0].prompt for g in a.get_groups(3)]
    state = json.loads(json.dumps(a.state_dict()))
    expected_next = [g[0].prompt for g in a.get_groups(12)]
    b = DataSource(_rows(10), 2, shuffle=True, seed=7)
    b.load_state_dict(state)
    assert [g[0].prompt for g in b.get_groups(12)] == expected_next
    assert len(set(first + expected_next[:7])) == 10  # one epoch: no prompt repeated or skipped


def test_returned_groups_come_back_first_and_survive_resume():
    a = DataSource(_rows(5), 2, shuffle=False, seed=0)
    g = a.get_groups(1)
    g[0][0].tokens = [1, 2, 3]
    a.add_groups(g)
    b = DataSource(_rows(5), 2, shuffle=False, seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    back = b.get_groups(2)
    assert back[0][0].tokens == [1, 2, 3] and back[0][0].prompt == "p0"
    assert back[1][0].prompt == "p1"


def test_resume_refuses_changed_data():
    a = DataSource(_rows(5), 2, shuffle=False, seed=0)
    with pytest.raises(DataError, match="saved with 5 prompt rows"):
        DataSource(_rows(6), 2, shuffle=False, seed=0).load_state_dict(a.state_dict())


def test_unreadable_and_empty_prompt_data_name_the_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=rf"^--prompt-data {tmp_path}/d: expected a .jsonl or .parquet file$"):
        read_rows(tmp_path / "d", "prompt", None, None)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(
        DataError, match=rf"^--prompt-data {tmp_path}/dir.jsonl: cannot read the file \(Is a directory\)$"
    ):
        read_rows(tmp_path / "dir.jsonl", "prompt", None, None)
    p = _write(tmp_path, ['{"prompt": "a"}'])
    p.chmod(0)
    if os.access(p, os.R_OK):  # root reads any file: the permission error is injected at the open call instead

        def denied(self, *a, **k):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(DataError, match=rf"^--prompt-data {p}: cannot read the file \(Permission denied\)$"):
        read_rows(p, "prompt", None, None)


def test_unreadable_bytes_and_parquet_name_the_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8 text \(invalid start byte at byte 13\)$"):
        read_rows(p, "prompt", None, None)
    q = tmp_path / "d.parquet"
    q.write_text("not parquet")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable parquet file \(ArrowInvalid: "):
        read_rows(q, "prompt", None, None)


@pytest.mark.parametrize("prompt", ["", "  \n", []])
def test_an_empty_prompt_names_its_line(tmp_path, prompt):
    p = _write(tmp_path, ['{"prompt": "a"}', "", json.dumps({"prompt": prompt})])
    with pytest.raises(
        DataError, match=rf"d\.jsonl:line 3: empty prompt in 'prompt' \(got {re.escape(repr(prompt))}\)"
    ):
        read_rows(p, "prompt", None, None)
