"""tests/support/cpu_accounting.py and cpu_session.py, the parts that need no cgroup: reading a group's counter, the
group names, which group ``/proc/self/cgroup`` names, the printed line and the session's JSON."""

from __future__ import annotations

import json

import pytest

from tests.support import cpu_session
from tests.support.cpu_accounting import (
    CpuAccountingError,
    CpuGroup,
    cpuacct_group_of,
    format_figures,
    group_name,
    nested_name,
    read_usage_s,
)

pytestmark = pytest.mark.unit


def test_usage_is_the_nanosecond_counter_in_seconds(tmp_path):
    (tmp_path / "cpuacct.usage").write_text("2500000000\n")
    assert read_usage_s(tmp_path) == 2.5
    (tmp_path / "cpuacct.usage").write_text("n/a\n")
    with pytest.raises(CpuAccountingError, match=r"cpuacct\.usage: cannot read a nanosecond count"):
        read_usage_s(tmp_path)
    with pytest.raises(CpuAccountingError, match=r"missing/cpuacct\.usage"):
        read_usage_s(tmp_path / "missing")


def test_group_names_are_one_folder_per_session_and_process():
    assert group_name("4242", "gw1") == "vime-tests/4242-gw1"
    for bad in ("", "a/b", ".."):
        with pytest.raises(ValueError, match="not a cgroup name part"):
            group_name(bad, "gw0")


def test_groups_nest_under_the_callers_group():
    """A measured command's group sits below the group its caller is measured in (a whole run and its files)."""
    assert nested_name("/", "vime-tests/1-gw0") == "vime-tests/1-gw0"
    assert nested_name("/vime-base", "vime-tests/1-gw0") == "vime-base/vime-tests/1-gw0"
    assert nested_name("/ci/job/", "vime-tests/1-main") == "ci/job/vime-tests/1-main"


def test_the_cpuacct_line_of_proc_self_cgroup():
    text = "4:memory:/process_api/ab\n3:cpuset:/\n2:cpu,cpuacct:/ci/job\n1:name=systemd:/\n0::/\n"
    assert cpuacct_group_of(text) == "/ci/job"
    assert cpuacct_group_of("2:cpuacct:/\n1:cpu:/\n") == "/"
    with pytest.raises(CpuAccountingError, match="no cgroup v1 cpuacct hierarchy"):
        cpuacct_group_of("0::/user.slice\n")


def test_a_group_that_cannot_be_created_names_the_path_and_the_need(tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("")
    with pytest.raises(
        CpuAccountingError, match=r"not-a-dir/vime-tests/1-gw0: cannot create a cpuacct group .* cgroup v1"
    ):
        CpuGroup(group_name("1", "gw0"), root=root)


def test_the_printed_figures():
    assert format_figures(120.0, 200.0) == "wall 120.0 s, CPU 200.0 s (1.67 cores busy)"
    assert format_figures(10.0, 5.0, 7.25) == (
        "wall 10.0 s, CPU 5.0 s (0.50 cores busy); machine CPU 7.2 s over the same time (every process, containers "
        "included)"
    )
    assert format_figures(0.0, 0.0) == "wall 0.0 s, CPU 0.0 s (0.00 cores busy)"


def test_the_session_json(tmp_path):
    out = tmp_path / "cpu.json"
    cpu_session.write(str(out), {"a.py": 10.04, "b.py": 30.0}, {"b.py": 55.55})
    assert json.loads(out.read_text()) == {
        "seconds": 40.0,
        "cpu_seconds": 55.5,
        "files": {"b.py": {"seconds": 30.0, "cpu_seconds": 55.5}, "a.py": {"seconds": 10.0, "cpu_seconds": 0.0}},
    }
    assert list(json.loads(out.read_text())["files"]) == ["b.py", "a.py"]  # longest first
