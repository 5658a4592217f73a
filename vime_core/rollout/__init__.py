"""The rollout side: vLLM engines, vllm-router, generate functions and the rollout manager."""
