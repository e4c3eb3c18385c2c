"""The server's error: an HTTP status and a message in OpenAI's shape, naming the field at fault."""
from __future__ import annotations


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    """A 400 naming the request field `param` (a path such as `tools[1].function.name`)."""
    return ApiError(400, message, param=param)
