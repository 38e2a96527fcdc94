"""The one error type of the API layer: an HTTP status with an OpenAI-style error body."""

from __future__ import annotations

from typing import Any

# OpenAI's error "type" for each status the router answers with.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

# The requests_total{status=...} label of each status (see router.metrics).
STATUS_LABELS = {
    400: "rejected_400",
    401: "unauthorized",
    404: "rejected_404",
    405: "rejected_405",
    413: "rejected_413",
    429: "overloaded",
    500: "error",
    503: "no_replica",
}


class APIError(Exception):
    """A request the router answers with an error; ``message`` says what is wrong."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.counted = False  # already in requests_total (set by the generation loop)

    @property
    def status_label(self) -> str:
        return STATUS_LABELS.get(self.status, f"error_{self.status}")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
