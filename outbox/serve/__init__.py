"""``outbox serve``: signals over HTTP, health and metrics."""
