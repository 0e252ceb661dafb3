"""OpenAI-shaped errors for every HTTP face of kvtoll (worker server and proxy).

A caller's mistake is a 4xx with the body
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` and never a
500. :func:`install_error_handlers` makes FastAPI answer that way for validation
errors, unknown routes and wrong methods; :func:`read_json_body` reads a request
body with a size cap, strict UTF-8 and strict JSON (no ``NaN``/``Infinity``) so
routes never see malformed input.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class OpenAIError(Exception):
    """An error that is answered as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON response carrying ``exc`` with its status."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def format_loc(loc: Sequence[int | str]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; drops pydantic's
    union-member tags and the ``body``/``query`` prefix FastAPI adds."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        if not parts and item in ("body", "query", "path", "header"):
            continue
        if item in _UNION_TAGS or "[" in item or "-" in item:
            break
        parts.append(item)
    return ".".join(parts) or None


def validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first validation problem as a 400 naming the offending parameter."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request")
    first = errors[0]
    param = format_loc(first.get("loc", ()))
    kind = str(first.get("type", ""))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "extra_forbidden" and param:
        return OpenAIError(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unrecognized_argument",
        )
    if kind == "missing" and param:
        return OpenAIError(f"Missing required parameter: '{param}'.", param=param, code="missing")
    where = f" ('{param}')" if param else ""
    return OpenAIError(f"Invalid value{where}: {message}", param=param, code="invalid_value")


def _reject_constant(name: str) -> Any:
    raise OpenAIError(
        f"We could not parse the JSON body of your request: {name} is not valid JSON",
        code="invalid_json",
    )


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8, strict JSON, top-level object; anything else is a 400."""
    if not raw.strip():
        raise OpenAIError("The request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(
            f"The request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        ) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise OpenAIError(
            f"We could not parse the JSON body of your request: {exc.msg} "
            f"(line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise OpenAIError("The JSON body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise OpenAIError(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError("The request body must be a JSON object", code="invalid_json")
    _reject_lone_surrogates(data)
    return data


def _reject_lone_surrogates(data: object) -> None:
    """``"\\ud800"`` is valid JSON but no valid text: refuse it like invalid UTF-8."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(
                    "The request body contains an unpaired UTF-16 surrogate escape",
                    code="invalid_encoding",
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def check_declared_length(declared: str | None, max_bytes: int) -> None:
    """Refuse a malformed Content-Length (400) or one over ``max_bytes`` (413) before
    any of the body is read."""
    if declared is not None:
        if not declared.isdigit():
            raise OpenAIError("Invalid Content-Length header", code="invalid_header")
        if int(declared) > max_bytes:
            raise body_too_large(max_bytes)


async def read_body_bytes(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The raw body, refusing (413) more than ``max_bytes`` before reading it all."""
    check_declared_length(request.headers.get("content-length"), max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(
    request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> dict[str, Any]:
    """The request body as a JSON object, or an :class:`OpenAIError` (400 / 413)."""
    return decode_json_body(await read_body_bytes(request, max_bytes))


def body_too_large(max_bytes: int) -> OpenAIError:
    """The 413 for a body over ``max_bytes``."""
    return OpenAIError(
        f"The request body is larger than {max_bytes} bytes",
        status=413,
        code="request_too_large",
    )


async def _on_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return error_response(validation_error(exc))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    err = OpenAIError(str(exc.detail), status=status, type=kind, code=code)
    return error_response(err, headers=dict(exc.headers or {}))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    err = OpenAIError(
        "The server had an error while processing your request",
        status=500,
        type=SERVER_ERROR,
        code="internal_error",
    )
    return error_response(err)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape (4xx for the caller's mistakes)."""
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
