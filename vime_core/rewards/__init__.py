"""Reward functions (built-ins; plugins add their own through ``vime_register_reward_functions``)."""
