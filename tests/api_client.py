"""A test client of the HTTP API that holds every answer to the OpenAPI document.

Each response is matched to its documented operation (method, path template)
and status, and its JSON body validated against the documented schema, so a
test that passes also shows the document describes what the server says.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import httpx
from jsonschema import Draft202012Validator

from outbox.serve.api.openapi import openapi_document
from outbox.serve.api.operations import API_PREFIX

TOKEN = "api-token-0123456789abcdef"


@cache
def _document() -> dict[str, Any]:
    return openapi_document()


@cache
def _templates() -> list[tuple[re.Pattern[str], str]]:
    found = []
    for path in _document()["paths"]:
        pattern = re.sub(r"\{[^}]+\}", "[^/]+", path)
        found.append((re.compile(f"^{pattern}$"), path))
    return found


#: What a route that is not in the document may answer (before or instead of routing).
UNROUTED = {
    401: "unauthenticated",
    404: "not_found",
    405: "method_not_allowed",
    503: "api_disabled",
}


def documented_schema(method: str, path: str, status: int) -> dict[str, Any]:
    """The schema the document gives for this answer (AssertionError if it gives none)."""
    relative = path.removeprefix(API_PREFIX)
    matches = [t for pattern, t in _templates() if pattern.match(relative)]
    # The most specific template: fewest parameters.
    matches.sort(key=lambda t: t.count("{"))
    operation = _document()["paths"][matches[0]].get(method.lower()) if matches else None
    if operation is None:
        assert status in UNROUTED, f"{method} {path} is not documented, yet answered {status}"
        return {"$ref": "#/components/schemas/ApiError"}
    answer = operation["responses"].get(str(status))
    assert answer is not None, f"{method} {matches[0]} does not document status {status}"
    schema: dict[str, Any] = answer["content"]["application/json"]["schema"]
    return schema


def check_against_document(response: httpx.Response) -> None:
    """Validate ``response`` (a JSON answer of the API) against the OpenAPI document."""
    request = response.request
    schema = documented_schema(request.method, request.url.path, response.status_code)
    validator = Draft202012Validator({**schema, "components": _document()["components"]})
    errors = sorted(validator.iter_errors(response.json()), key=lambda e: list(e.path))
    assert not errors, f"{request.method} {request.url.path} {response.status_code}: " + "; ".join(
        f"{list(e.path)}: {e.message}" for e in errors[:5]
    )


class ApiClient(httpx.Client):
    """An ``httpx.Client`` on ``{base}/api/v1`` with the token; checks every answer."""

    def __init__(self, base_url: str, token: str | None = TOKEN, **kwargs: Any) -> None:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        super().__init__(base_url=base_url + API_PREFIX, headers=headers, **kwargs)

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = super().send(request, **kwargs)
        if response.headers.get("content-type", "").startswith("application/json"):
            response.read()
            check_against_document(response)
        return response
