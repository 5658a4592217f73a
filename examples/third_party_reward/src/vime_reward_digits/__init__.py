"""Example third-party vime plugin: the ``digit_fraction`` reward."""
