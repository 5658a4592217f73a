"""vime-agent-codex: the Codex CLI (npm @openai/codex) as a vime agent harness."""
