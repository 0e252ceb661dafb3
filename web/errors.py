"""OpenAI-shaped JSON errors for the web routes: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A caller's mistake (4xx) or a refusal, rendered in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        """The JSON response for this error."""
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_param(param: str, message: str) -> ApiError:
    """A 400 for one malformed query parameter."""
    return ApiError(400, message, param=param, code="invalid_parameter")


def unauthorized(message: str = "invalid or missing API key") -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def not_found(message: str) -> ApiError:
    return ApiError(404, message, code="not_found")
