"""The OpenAPI 3.1 document of the HTTP API, generated from its routes and their models.

:data:`~outbox.serve.api.operations.OPERATIONS` gives the paths, methods and
answers; the pydantic models give every schema (request bodies as validated,
answers as serialised), under ``components/schemas``. ``outbox schemas export``
writes it to ``schemas/http-api.openapi.json``; a test checks that file is in
sync and that the document validates against the OpenAPI 3.1 schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from outbox.serve.api.models import ERROR_CODES, ApiError
from outbox.serve.api.operations import (
    API_PREFIX,
    COMMON_REFUSALS,
    OPENAPI_PATH,
    OPERATIONS,
    Operation,
)

__all__ = ["openapi_document"]

_REF = "#/components/schemas/{model}"
_JSON = "application/json"

_DESCRIPTION = """\
For agents that cannot reach PostgreSQL: start a run, record steps with their
effect intents (atomically, replayed by step id), send signals, finish runs,
read runs and effects, and await an effect's outcome with a long poll. Every
write goes through agent-outbox's Python client, so validation, idempotency
keys, replay and wake-ups are the same as from Python.

Every route but this document wants `Authorization: Bearer <OUTBOX_API_TOKEN>`.
Every refusal is a JSON `ApiError` with a stable `code`; `field` names the
offending input. The guide: docs/http-api.md.
"""

_PATH_PARAM_DESCRIPTIONS = {
    "run_id": "The run's id.",
    "effect_id": "The effect's id.",
}


def _statuses(op: Operation) -> dict[int, list[str]]:
    """Refusal codes of ``op`` by HTTP status."""
    by_status: dict[int, list[str]] = {}
    for code in (*op.refusals, *COMMON_REFUSALS):
        by_status.setdefault(ERROR_CODES[code][0], []).append(code)
    return by_status


_Refs = dict[tuple[type[BaseModel], JsonSchemaMode], Any]


def _schemas() -> tuple[_Refs, dict[str, Any]]:
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ApiError, "serialization")]
    for op in OPERATIONS:
        if op.body is not None:
            wanted.append((op.body, "validation"))
        if op.query is not None:
            wanted.append((op.query, "validation"))
        wanted += [(model, "serialization") for model in op.answers.values()]
    unique = list(dict.fromkeys(wanted))
    refs, top = models_json_schema(unique, ref_template=_REF)
    return dict(refs), top.get("$defs", {})  # type: ignore[arg-type]


def _schema_name(ref: dict[str, Any]) -> str:
    return str(ref["$ref"]).rsplit("/", 1)[1]


def _operation(
    op: Operation,
    refs: _Refs,
    schemas: dict[str, Any],
) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "description": _PATH_PARAM_DESCRIPTIONS.get(name, name),
            "schema": {"type": "string", "format": "uuid"},
        }
        for name in op.path_params
    ]
    if op.query is not None:
        query = schemas[_schema_name(refs[(op.query, "validation")])]
        required = set(query.get("required", ()))
        for name, schema in query["properties"].items():
            parameter = {"name": name, "in": "query", "required": name in required}
            described = dict(schema)
            if "description" in described:
                parameter["description"] = described.pop("description")
            parameters.append({**parameter, "schema": described})
    responses: dict[str, Any] = {}
    for status, model in sorted(op.answers.items()):
        responses[str(status)] = {
            "description": (model.__doc__ or model.__name__).strip().split("\n\n")[0],
            "content": {_JSON: {"schema": refs[(model, "serialization")]}},
        }
    error_ref = refs[(ApiError, "serialization")]
    for status, codes in sorted(_statuses(op).items()):
        meanings = "; ".join(f"`{code}`: {ERROR_CODES[code][1]}" for code in codes)
        responses[str(status)] = {
            "description": meanings,
            "content": {_JSON: {"schema": error_ref}},
        }
    spec: dict[str, Any] = {
        "operationId": op.handler,
        "summary": op.summary,
        "description": op.description,
        "tags": [op.path.split("/")[1]],
        "responses": responses,
    }
    if parameters:
        spec["parameters"] = parameters
    if op.body is not None:
        spec["requestBody"] = {
            "required": True,
            "content": {_JSON: {"schema": refs[(op.body, "validation")]}},
        }
    return spec


def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI 3.1 document (paths relative to :data:`API_PREFIX`)."""
    refs, schemas = _schemas()
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, refs, schemas)
    paths[OPENAPI_PATH] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "description": "The OpenAPI document of this API; no token needed.",
            "tags": ["meta"],
            "security": [],
            "responses": {
                "200": {
                    "description": "The OpenAPI 3.1 document.",
                    "content": {_JSON: {"schema": {"type": "object"}}},
                }
            },
        }
    }
    # Query models are spelled out as parameters; they are not bodies of their own.
    for op in OPERATIONS:
        if op.query is not None:
            schemas.pop(op.query.__name__, None)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agent-outbox HTTP API",
            "version": "1.0",
            "description": _DESCRIPTION,
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [{"url": API_PREFIX, "description": "relative to `outbox serve`"}],
        "security": [{"bearer": []}],
        "tags": [
            {"name": "runs", "description": "Runs: start, steps, signals, end, reads."},
            {"name": "effects", "description": "Effects: reads and the long poll."},
            {"name": "meta", "description": "The API itself."},
        ],
        "paths": paths,
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The token of OUTBOX_API_TOKEN (or OUTBOX_API_TOKEN_FILE).",
                }
            },
        },
    }
