"""RPC errors with details, both ends.

The server aborts with a canonical status code and a one-line message (for bad input
``<field>: <rule>``, as the CLI prints it), and attaches an ``ErrorDetail`` — reason, field,
retry-after — packed in a google.rpc.Status-compatible message in the standard
``grpc-status-details-bin`` trailer, where generic tools look for it. The client reads it back
with :func:`detail_of`.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2

from stage_cosim.bridge.jobs import clip
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb

DETAILS_KEY = "grpc-status-details-bin"
MAX_MESSAGE_CHARS = 1000


class RpcAbort(Exception):
    """Raised inside a handler; the servicer turns it into ``context.abort``."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str, field: str = "",
                 retry_after_s: float = 0.0) -> None:
        message = clip(" ".join(message.split()), MAX_MESSAGE_CHARS)      # trailers are small
        super().__init__(message)
        self.code, self.message = code, message
        self.detail = pb.ErrorDetail(reason=reason, field=field, description=message, retry_after_s=retry_after_s)

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        packed = any_pb2.Any()
        packed.Pack(self.detail)
        status = pb.RpcStatus(code=self.code.value[0], message=self.message, details=[packed])
        return ((DETAILS_KEY, status.SerializeToString()),)


def invalid(field: str, rule: str) -> RpcAbort:
    return RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {rule}", "INVALID_FIELD", field)


def detail_of(error: grpc.RpcError) -> pb.ErrorDetail | None:
    """The ErrorDetail a bridge server attached to ``error``, if any."""
    metadata = getattr(error, "trailing_metadata", None)
    for key, value in (metadata() if callable(metadata) else None) or ():
        if key == DETAILS_KEY:
            status = pb.RpcStatus.FromString(value)
            for packed in status.details:
                detail = pb.ErrorDetail()
                if packed.Unpack(detail):
                    return detail
    return None
