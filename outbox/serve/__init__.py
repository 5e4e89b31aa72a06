"""``outbox serve``: signed signals over HTTP, health, metrics and the operator console."""
