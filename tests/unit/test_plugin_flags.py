"""vime_core.plugin_flags: a plugin reads its own flags with their defaults taken from the flag definitions."""

import argparse

import pytest

from vime_core.plugin_flags import flag_defaults, own_flags

pytestmark = pytest.mark.unit


def _add(parser):
    g = parser.add_argument_group("my-plugin")
    g.add_argument("--my-plugin-timeout", type=float, default=120.0, help="seconds")
    g.add_argument("--my-plugin-tags", action="append", default=[], help="repeatable")
    g.add_argument("--my-plugin-fast", action="store_true", help="go fast")


def test_values_from_args_defaults_for_what_args_lacks():
    got = own_flags(argparse.Namespace(my_plugin_timeout=5.0, sandbox="docker"), _add)
    assert vars(got) == {"my_plugin_timeout": 5.0, "my_plugin_tags": [], "my_plugin_fast": False}
    assert vars(own_flags(None, _add)) == flag_defaults(_add)
    # a default that is a mutable object is copied: a caller appending to it does not change the definition's
    own_flags(None, _add).my_plugin_tags.append("x")
    assert flag_defaults(_add)["my_plugin_tags"] == []


def test_a_parsed_namespace_is_read_as_is():
    parser = argparse.ArgumentParser()
    _add(parser)
    args = parser.parse_args(["--my-plugin-fast", "--my-plugin-tags", "a"])
    assert vars(own_flags(args, _add)) == {"my_plugin_timeout": 120.0, "my_plugin_tags": ["a"], "my_plugin_fast": True}
