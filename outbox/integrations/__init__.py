"""Framework adapters: agents written with Pydantic AI or LangGraph, run as agent-outbox runs.

Each adapter is an optional extra (``pip install 'agent-outbox[pydantic-ai]'``,
``'agent-outbox[langgraph]'``) and imports its framework only when imported.
"""
