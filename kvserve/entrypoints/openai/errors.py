"""``APIError``: an HTTP status with OpenAI's error body; how engine and input errors map to one."""

from __future__ import annotations

from typing import Any, Optional

from kvserve.engine.async_client import EngineDeadError, RequestFailedError
from kvserve.entrypoints.openai import protocol as P

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, type_: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return P.error_body(self.message, self.type, self.param, self.status)

    @classmethod
    def from_exception(cls, exc: BaseException) -> "APIError":
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, EngineDeadError):
            return cls(503, f"the engine is not available: {exc}")
        if isinstance(exc, RequestFailedError):
            return cls(500, str(exc))
        if isinstance(exc, (ValueError, TypeError)):
            return cls(400, str(exc), P.param_of(str(exc)))
        return cls(500, f"internal error: {type(exc).__name__}: {exc}")
