"""The docs' flag tables agree with the one declaration of each flag (vime_core/config/): every row
``| `--flag ...` |`` of a table in docs/ names a flag ``vime run`` has, and a table's ``default`` column states the
declared default (a literal value: number, ``code``, off/on, none, N MiB), or is prose ("the tokenizer's") for a
flag whose declared default is ``None``."""

import re
from pathlib import Path

import pytest

from vime_core.cli.arguments import build_parser

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\|\s*`(--[a-z0-9-]+)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def flag_rows() -> list[tuple[str, str, str | None]]:
    """``(where, flag, default cell or None)`` for every flag row of every docs table; the default cell is the
    column headed ``default`` of the row's table, if it has one."""
    rows = []
    for path in sorted(DOCS.glob("*.md")):
        header: list[str] | None = None
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("|"):
                header = None
                continue
            if line.startswith("|---") or line.startswith("| ---"):
                continue
            m = ROW.match(line)
            if not m:
                header = _cells(line)
                continue
            cells = _cells(line)
            col = header.index("default") if header and "default" in header else None
            rows.append((f"{path.name}:{n}", m.group(1), cells[col] if col is not None else None))
    return rows


def _literal(cell: str):
    """The value a default cell states, or ``...`` when it is prose."""
    text = cell.strip("`")
    if cell in ("none", "—"):
        return None
    if cell in ("off",) or cell.startswith("off "):
        return False
    if cell == "on":
        return True
    if m := re.fullmatch(r"(\d+) MiB", cell):
        return int(m.group(1)) << 20
    if re.fullmatch(r"-?\d+(\.\d+)?", cell):
        return float(cell)
    if cell.startswith("`") and cell.endswith("`") and not text.startswith("--"):
        return text
    return ...


def _agrees(stated, default) -> bool:
    if isinstance(stated, float):
        return isinstance(default, int | float) and not isinstance(default, bool) and float(default) == stated
    if stated is False:  # "off": a switch that is off, or an optional feature left unset
        return default in (False, None)
    if isinstance(stated, str) and isinstance(default, list):
        return default == [stated]
    return stated == default


def test_every_documented_flag_exists_and_its_default_is_the_declared_one():
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    rows = flag_rows()
    assert len(rows) > 60, "the docs' flag tables were not found"
    problems = []
    for where, flag, cell in rows:
        action = actions.get(flag)
        if action is None:
            problems.append(f"{where}: {flag} is not a vime run flag")
            continue
        if cell is None:
            continue
        stated = _literal(cell)
        if stated is ...:
            if action.default is not None:
                problems.append(
                    f"{where}: {flag} default {cell!r} is prose, but the declared default is {action.default!r}"
                )
        elif not _agrees(stated, action.default):
            problems.append(f"{where}: {flag} documents default {cell!r}, declared {action.default!r}")
    assert not problems, "\n".join(problems)


def test_the_default_cell_reader():
    assert [_literal(c) for c in ("none", "—", "off", "off (disaggregated)", "on", "1 MiB", "5.0", "`hermes`")] == [
        None,
        None,
        False,
        False,
        True,
        1 << 20,
        5.0,
        "hermes",
    ]
    assert _literal("the tokenizer's") is ... and _literal("`--rollout-max-response-len`") is ...
    assert _agrees(16.0, 16) and not _agrees(16.0, True) and _agrees("all-linear", ["all-linear"])
