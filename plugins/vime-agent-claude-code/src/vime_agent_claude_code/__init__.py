"""vime-agent-claude-code: Claude Code (npm @anthropic-ai/claude-code) as a vime agent harness."""
