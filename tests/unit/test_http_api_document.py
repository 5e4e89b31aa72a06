"""The HTTP API's OpenAPI document: valid OpenAPI 3.1, complete, in sync, and documented."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError

from outbox.json_schemas import OPENAPI_FILE
from outbox.serve.api.handlers import ApiHandlers
from outbox.serve.api.models import ERROR_CODES, ErrorCode
from outbox.serve.api.openapi import openapi_document
from outbox.serve.api.operations import API_PREFIX, OPERATIONS
from tests.api_client import check_against_document

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "http-api.md"


def test_the_document_is_valid_openapi_3_1() -> None:
    document = openapi_document()
    assert document["openapi"] == "3.1.0"
    validate(document)  # against the OpenAPI 3.1 schema shipped with openapi-spec-validator


def test_the_validator_refuses_a_broken_document() -> None:
    broken = openapi_document()
    # A path parameter must say it is required.
    del broken["paths"]["/runs/{run_id}"]["get"]["parameters"][0]["required"]
    with pytest.raises(OpenAPIValidationError):
        validate(broken)


def test_the_checked_in_document_is_the_generated_one() -> None:
    on_disk = json.loads((ROOT / "schemas" / OPENAPI_FILE).read_text())
    assert on_disk == openapi_document(), "run `outbox schemas export` and commit schemas/"


def test_every_route_has_a_handler_and_a_documented_operation() -> None:
    paths = openapi_document()["paths"]
    for op in OPERATIONS:
        assert callable(getattr(ApiHandlers, op.handler)), op.handler
        assert op.method.lower() in paths[op.path], (op.method, op.path)
        if op.body is not None:
            assert {"malformed", "invalid", "unsupported_media_type"} <= set(op.refusals)
    assert len({(op.method, op.path) for op in OPERATIONS}) == len(OPERATIONS)


def test_error_codes_are_one_list() -> None:
    assert set(typing.get_args(ErrorCode)) == set(ERROR_CODES)
    document = openapi_document()
    enum = document["components"]["schemas"]["ApiError"]["properties"]["code"]["enum"]
    assert set(enum) == set(ERROR_CODES)


def test_the_guide_names_every_route_and_error_code() -> None:
    guide = DOC.read_text()
    for op in OPERATIONS:
        assert f"{op.method} {API_PREFIX}{op.path}" in guide, f"{op.method} {op.path}"
    for code, (status, _) in ERROR_CODES.items():
        assert f"`{code}`" in guide and str(status) in guide, code
    assert "OUTBOX_API_TOKEN" in guide and "--max-body-bytes" in guide


def _response(method: str, path: str, status: int, body: object) -> httpx.Response:
    request = httpx.Request(method, f"http://server{API_PREFIX}{path}")
    return httpx.Response(status, json=body, request=request)


def test_answers_are_held_to_the_document() -> None:
    error = {"error": "x", "code": "run_not_found", "field": "run_id"}
    check_against_document(_response("GET", "/runs/0a", 404, error))
    with pytest.raises(AssertionError, match="code"):
        check_against_document(_response("GET", "/runs/0a", 404, {**error, "code": "oops"}))
    with pytest.raises(AssertionError, match="runs"):
        check_against_document(_response("GET", "/runs", 200, {"rows": []}))
    with pytest.raises(AssertionError, match="does not document status 201"):
        check_against_document(_response("GET", "/runs", 201, {"runs": []}))
