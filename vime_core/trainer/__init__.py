"""Trainer backends: ``torch`` (HF model + torch optimizer; CPU or one GPU) and, later, ``megatron``."""
