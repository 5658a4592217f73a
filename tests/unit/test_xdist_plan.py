"""tests/support/xdist_plan.py: which unit of work each test file is in, the longest-first order, and the check that
the list of session-engine files is up to date."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support import xdist_plan

pytestmark = pytest.mark.unit


def _item(nodeid: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures))


def test_units_are_files_except_the_two_groups():
    assert xdist_plan.group_of("tests/unit/test_config.py") == "tests/unit/test_config.py"
    assert xdist_plan.group_of("tests/integration/test_rollout_engine.py") == "session-engine"
    assert xdist_plan.group_of("plugins/vime-sandbox-localvm/tests/test_localvm.py") == "memory-heavy"
    assert xdist_plan.group_of("tests/integration/test_cluster_two_node.py") == "memory-heavy"
    scheduler_scope = xdist_plan.GroupScheduling._split_scope
    assert scheduler_scope(None, "tests/integration/test_weight_sync_nccl.py::test_x[a::b]") == "session-engine"


def test_longest_units_first_and_collection_order_within_a_unit(monkeypatch):
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
