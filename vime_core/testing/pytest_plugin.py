"""pytest plugin of the contract kit (entry point ``pytest11: vime``); registers vime's markers."""


def pytest_configure(config):
    for marker in ("unit", "contract", "integration", "gpu", "slow"):
        config.addinivalue_line("markers", f"{marker}: vime test layer")
