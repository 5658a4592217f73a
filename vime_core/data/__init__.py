"""Prompt data: readers, the data buffer, dataset exporters."""
