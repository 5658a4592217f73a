"""The contract kit's flag checks on this plugin's ``vime_add_arguments`` (every flag has help)."""

import pytest

from vime_core.testing import PluginArgumentsContract

pytestmark = pytest.mark.contract


class TestFlags(PluginArgumentsContract):
    @pytest.fixture
    def add_arguments(self):
        from vime_agent_claude_code.hooks import vime_add_arguments

        return vime_add_arguments
