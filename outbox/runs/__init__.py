"""The agent side: runs and their steps, intents, waits, signals, stopping, and run workers."""
