"""The one exception type of the kvferry client, and its translation from gRPC errors."""

from __future__ import annotations

import contextlib

import grpc

# Trailing-metadata key in which kvferryd sends the ErrorReason name of a failed call.
REASON_KEY = "kvferry-error-reason"


class Error(Exception):
    """A failed kvferry operation.

    Attributes:
      code: the grpc.StatusCode (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
        RESOURCE_EXHAUSTED, ALREADY_EXISTS, DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE, ...).
      message: what was wrong, as the daemon (or the client) says it.
      reason: the daemon's machine-readable ErrorReason name (e.g. "POOL_NOT_FOUND",
        "STALE_PAGE_HANDLE"); "" when the daemon sent none, or when the client itself
        found the problem (bad arguments: INVALID_ARGUMENT; a corrupt or out-of-order
        response chunk: DATA_LOSS) before or after talking to the daemon.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(f"{code.name}: {message}" + (f" [{reason}]" if reason else ""))
        self.code = code
        self.message = message
        self.reason = reason

    def __reduce__(self):  # so an Error survives pickling (multiprocessing, futures)
        return Error, (self.code, self.message, self.reason)


def invalid_argument(message: str) -> Error:
    """An Error for arguments the client refuses before sending anything."""
    return Error(grpc.StatusCode.INVALID_ARGUMENT, message)


def _reason(call: grpc.RpcError) -> str:
    trailing = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def from_rpc_error(error: grpc.RpcError) -> Error:
    """The Error for a failed gRPC call (code, details and the reason trailer)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return Error(code or grpc.StatusCode.UNKNOWN, details or "", _reason(error))


@contextlib.contextmanager
def translated():
    """Re-raises grpc.RpcError raised inside the block as Error (the original chained)."""
    try:
        yield
    except grpc.RpcError as error:
        raise from_rpc_error(error) from error
