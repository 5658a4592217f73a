"""The router policy per generate function (measured in bench/router_policy.py, docs/router.md) and the
``--router-policy`` override."""

import pytest

from vime_core.engines.router import router_policy

pytestmark = pytest.mark.unit


def test_session_generate_functions_default_to_a_sticky_policy():
    assert router_policy("multi_turn", []) == ("sticky_least_loaded", [])
    assert router_policy("coding_agent", ["--request-timeout-secs", "30"]) == (
        "sticky_least_loaded",
        ["--request-timeout-secs", "30"],
    )
    assert router_policy("default", []) == ("round_robin", [])
    assert router_policy("my_pkg.gen:generate", []) == ("round_robin", [])


def test_router_policy_flag_wins_and_is_passed_once():
    args = ["--policy", "consistent_hash", "--request-timeout-secs", "30"]
    assert router_policy("multi_turn", args) == ("consistent_hash", ["--request-timeout-secs", "30"])
    assert router_policy("default", ["--policy=cache_aware"]) == ("cache_aware", [])
