"""tests/support/tiers.py: every test file is placed in a tier on purpose, the plan agrees with the marks, the gate's
recorded seconds fit CI's budget, and the README, .ci/run and docs/testing.md give the two tiers' commands."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.support import tiers, xdist_plan

pytestmark = pytest.mark.unit

PLACE = (
    "add its path to GATE_FILES in tests/support/tiers.py, or mark it `pytestmark = [..., pytest.mark.extended]` "
    "(docs/testing.md, tiers)"
)


def test_every_test_file_is_in_a_tier():
    unplaced = [f for f in tiers.suite_files() if tiers.tier_of_file(f) is None]
    assert not unplaced, f"test files in no tier: {unplaced}; {PLACE}"


def test_the_gate_plan_names_existing_test_files_only():
    files = set(tiers.suite_files())
    assert not sorted(tiers.GATE_FILES - files), "GATE_FILES names files pytest does not collect"
    assert "tests/unit/test_tiers.py" in tiers.GATE_FILES and "tests/gpu/test_megatron_backend.py" in files


def test_a_file_in_the_gate_plan_and_marked_extended_as_a_whole_is_refused(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.extended]\n"
    )
    (tmp_path / "tests" / "test_y.py").write_text("import pytest\n\npytestmark = pytest.mark.unit\n")
    (tmp_path / "tests" / "test_z.py").write_text("import pytest\n\npytestmark = pytest.mark.extended\n")
    monkeypatch.setattr(tiers, "GATE_FILES", frozenset({"tests/test_x.py", "tests/test_y.py"}))
    with pytest.raises(
        ValueError, match=r"tests/test_x\.py: in tests/support/tiers\.py GATE_FILES and marked 'extended'"
    ):
        tiers.tier_of_file("tests/test_x.py", root=tmp_path)
    assert tiers.tier_of_file("tests/test_y.py", root=tmp_path) == "gate"
    assert tiers.tier_of_file("tests/test_z.py", root=tmp_path) == "extended"
    monkeypatch.setattr(tiers, "GATE_FILES", frozenset())
    assert tiers.tier_of_file("tests/test_y.py", root=tmp_path) is None  # in no tier: the first test above fails


def test_module_marks_are_read_from_the_pytestmark_assignment():
    src = (
        "import pytest\n"
        "pytestmark = [pytest.mark.integration, pytest.mark.skipif(X, reason='r'), pytest.mark.extended]\n"
        "@pytest.mark.gpu\n"
        "def test_a():\n"
        "    pytestmark = pytest.mark.slow\n"
    )
    assert tiers.module_marks(src) == {"integration", "skipif", "extended"}  # not the test's own marks
    assert tiers.module_marks("import pytest\npytestmark: list = pytest.mark.gpu\n") == {"gpu"}
    assert tiers.module_marks("import pytest\n\ndef test_a():\n    pass\n") == set()


def test_the_gate_fits_the_budget():
    """The gate's recorded seconds (this machine's table; CI is up to ~1.4x slower) fit 35 minutes on two workers,
    and no unit of work is too long for the two workers to finish together."""
    seconds = tiers.gate_seconds(xdist_plan.expected_seconds(), xdist_plan.expected_extended_seconds())
    total = sum(seconds.values())
    longest = sorted(seconds.items(), key=lambda r: -r[1])[:8]
    assert total <= tiers.GATE_BUDGET_S, (
        f"the gate's recorded seconds sum {total:.0f} s, over the {tiers.GATE_BUDGET_S:.0f} s budget: make tests "
        f"cheaper or mark some `extended` (docs/testing.md, tiers); the longest: {longest}"
    )
    units: dict[str, float] = defaultdict(float)
    for path, s in seconds.items():
        units[xdist_plan.group_of(path)] += s
    unit, longest_unit = max(units.items(), key=lambda r: r[1])
    assert longest_unit <= tiers.UNIT_BUDGET_S, f"the gate's unit {unit!r} takes {longest_unit:.0f} s"


def test_the_gate_seconds_are_each_files_total_less_its_extended_share():
    got = tiers.gate_seconds(
        {"a.py": 100.0, "b.py": 20.0, "c.py": 5.0}, {"a.py": 70.0, "b.py": 30.0}, {"a.py", "b.py", "d.py"}
    )
    assert got == {"a.py": 30.0, "b.py": 0.0, "d.py": 0.0}


def test_the_seconds_tables_name_existing_files_and_shares_within_totals():
    total, extended = xdist_plan.expected_seconds(), xdist_plan.expected_extended_seconds()
    files = set(tiers.suite_files())
    assert not sorted(set(total) - files), "tests/file_seconds.json lists files that are gone"
    assert not sorted(set(extended) - files), "tests/file_seconds_extended.json lists files that are gone"
    assert not {f: (s, total.get(f)) for f, s in extended.items() if s > total.get(f, 0.0)}


def test_the_readme_ci_and_docs_give_both_commands():
    readme = (tiers.ROOT / "README.md").read_text()
    ci = (tiers.ROOT / ".ci" / "run").read_text().splitlines()
    testing = (tiers.ROOT / "docs" / "testing.md").read_text()
    assert tiers.GATE_COMMAND in ci, ".ci/run must run the README's test command, the same line"
    for text in (readme, testing):
        assert tiers.GATE_COMMAND in text and tiers.EXTENDED_COMMAND in text
    # the README's first pytest command with -m is the gate (the one .ci/run runs)
    first = next(line for line in readme.splitlines() if "pytest" in line and " -m " in line)
    assert first.endswith(tiers.GATE_COMMAND), first
