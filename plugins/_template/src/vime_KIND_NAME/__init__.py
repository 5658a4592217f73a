"""vime plugin KIND-NAME."""
