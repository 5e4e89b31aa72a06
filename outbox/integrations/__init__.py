"""Framework adapters: Pydantic AI, LangGraph and OpenAI Agents SDK agents as agent-outbox runs.

Each adapter is an optional extra (``pip install 'agent-outbox[pydantic-ai]'``,
``'agent-outbox[langgraph]'``, ``'agent-outbox[openai-agents]'``) and imports
its framework only when imported.
"""
