"""Weight-sync strategies: how a trainer's new weights reach the running vLLM engines."""
