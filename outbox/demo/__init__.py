"""The demo's invoice-reconciliation agent (``outbox demo``)."""
