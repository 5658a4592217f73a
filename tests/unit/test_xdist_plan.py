"""tests/support/xdist_plan.py: which unit of work each test file is in, the longest-first order, and the check that
the list of session-engine files is up to date."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.support import xdist_plan

pytestmark = pytest.mark.unit


def _item(nodeid: str, *fixtures: str, extended: bool = False) -> SimpleNamespace:
    mark = SimpleNamespace(name="extended") if extended else None
    return SimpleNamespace(
        nodeid=nodeid,
        fixturenames=list(fixtures),
        get_closest_marker=lambda name: mark if name == "extended" else None,
    )


def test_units_are_files_except_the_two_groups():
    assert xdist_plan.group_of("tests/unit/test_config.py") == "tests/unit/test_config.py"
    assert xdist_plan.group_of("tests/integration/test_rollout_engine.py") == "session-engine"
    assert xdist_plan.group_of("plugins/vime-sandbox-localvm/tests/test_localvm.py") == "memory-heavy"
    assert xdist_plan.group_of("tests/integration/test_cluster_two_node.py") == "memory-heavy"
    scheduler_scope = xdist_plan.GroupScheduling._split_scope
    assert scheduler_scope(None, "tests/integration/test_weight_sync_nccl.py::test_x[a::b]") == "session-engine"


def test_longest_units_first_and_collection_order_within_a_unit(monkeypatch):
    monkeypatch.setattr(xdist_plan, "expected_extended_seconds", dict)
    monkeypatch.setattr(
        xdist_plan,
        "expected_seconds",
        lambda: {
            "a.py": 5.0,
            "b.py": 50.0,
            "tests/integration/test_rollout_engine.py": 30.0,
            "tests/integration/test_weight_sync_nccl.py": 30.0,
        },
    )
    items = [
        _item("a.py::t1"),
        _item("tests/integration/test_rollout_engine.py::t2"),
        _item("b.py::t3"),
        _item("c.py::t4"),  # not in the table: 0 s, last
        _item("tests/integration/test_weight_sync_nccl.py::t5"),
        _item("b.py::t6"),
    ]
    # session-engine (30 + 30 s) before b.py (50 s), then a.py (5 s), then c.py
    assert [i.nodeid.split("::")[1] for i in xdist_plan.order(items)] == ["t2", "t5", "t3", "t6", "t1", "t4"]


def test_an_out_of_date_session_engine_list_is_refused_naming_the_file():
    with pytest.raises(pytest.UsageError, match=r"add \['tests/unit/test_new\.py'\], drop \[\]"):
        xdist_plan.check_groups([_item("tests/unit/test_new.py::t", "vllm_server")])
    stale = "tests/integration/test_rollout_engine.py"
    with pytest.raises(pytest.UsageError, match=rf"add \[\], drop \['{stale}'\]"):
        xdist_plan.check_groups([_item(f"{stale}::t", "tmp_path")])
    xdist_plan.check_groups([_item(f"{stale}::t", "router"), _item("tests/unit/test_x.py::t", "tmp_path")])


def test_a_tier_run_orders_by_that_tiers_share_of_each_file(monkeypatch):
    """A file of 100 s whose extended tests take 90 s counts 10 s in a gate run, 90 s in an extended run, 100 s when
    both run; a file without a recorded share counts whole."""
    monkeypatch.setattr(xdist_plan, "expected_seconds", lambda: {"split.py": 100.0, "b.py": 50.0, "new.py": 60.0})
    monkeypatch.setattr(xdist_plan, "expected_extended_seconds", lambda: {"split.py": 90.0})
    gate = [_item("b.py::g"), _item("split.py::g")]
    assert [i.nodeid for i in xdist_plan.order(gate)] == ["b.py::g", "split.py::g"]  # 50 s before 10 s
    extended = [_item("b.py::e", extended=True), _item("split.py::e", extended=True)]
    assert [i.nodeid for i in xdist_plan.order(extended)] == ["split.py::e", "b.py::e"]  # 90 s before 50 s
    assert xdist_plan.tier_share(100.0, 90.0, {"gate", "extended"}) == 100.0
    assert xdist_plan.tier_share(60.0, None, {"extended"}) == 60.0
    assert xdist_plan.tier_share(10.0, 30.0, {"gate"}) == 0.0  # a share larger than an older total: none left


def test_tables_merge_the_tiers_that_ran_and_keep_the_others():
    old_total = {"split.py": 100.0, "gate.py": 40.0, "ext.py": 70.0}
    old_extended = {"split.py": 90.0, "ext.py": 70.0}
    # a gate run: split.py's gate tests took 12 s, gate.py 35 s, a new file 5 s
    gate_run = {"split.py": {"gate": 12.0}, "gate.py": {"gate": 35.0}, "new.py": {"gate": 5.0}}
    total, extended = xdist_plan.merged_seconds(old_total, old_extended, gate_run)
    assert total == {"split.py": 102.0, "gate.py": 35.0, "ext.py": 70.0, "new.py": 5.0}
    assert extended == {"split.py": 90.0, "ext.py": 70.0, "gate.py": 0.0, "new.py": 0.0}
    # then an extended run: split.py's extended tests took 80 s, ext.py 60 s
    total, extended = xdist_plan.merged_seconds(
        total, extended, {"split.py": {"extended": 80.0}, "ext.py": {"extended": 60.0}}
    )
    assert total == {"split.py": 92.0, "gate.py": 35.0, "ext.py": 60.0, "new.py": 5.0}
    assert extended == {"split.py": 80.0, "ext.py": 60.0, "gate.py": 0.0, "new.py": 0.0}


def test_written_tables_are_rounded_longest_first_and_only_of_existing_files(tmp_path):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("")
    table = tmp_path / "seconds.json"
    table.write_text(json.dumps({"gone.py": 30, "b.py": 2}))
    xdist_plan.write_seconds(str(table), {"a.py": {"gate": 3.4, "extended": 7.3}, "tiny.py": {"gate": 0.4}}, tmp_path)
    assert table.read_text() == '{\n "a.py": 11,\n "b.py": 2\n}\n'
    assert json.loads((tmp_path / "seconds_extended.json").read_text()) == {"a.py": 7}
