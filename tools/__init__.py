"""Developer tools for agent-outbox (not installed with the package)."""
