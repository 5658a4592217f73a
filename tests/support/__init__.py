"""Helpers shared by several test modules (they hold no tests): stand-ins for what a test does not exercise,
and the fixed inputs more than one module checks."""
