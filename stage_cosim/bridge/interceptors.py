"""The server's gRPC interceptors, outermost first: a request's bytes that do not decode reach
the method as :class:`Undecodable` (answered INVALID_ARGUMENT); with a token, a call without it
is refused (:class:`TokenAuth`); one host holds at most so many connections with calls in flight
(:class:`PeerConnections`). The health service is never refused.
"""

from __future__ import annotations

import collections
import hmac
import inspect
from typing import Any, AsyncIterator, Callable

import grpc

from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.status import RpcAbort, invalid

SERVICE = pb.DESCRIPTOR.services_by_name["Bridge"].full_name
HEALTH_PREFIX = "/grpc.health.v1.Health/"


# -- requests that do not decode -------------------------------------------------------------------

class Undecodable:
    """What a request's bytes become when they are not the method's message (see RequestDecoding)."""

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type

    def refuse(self) -> RpcAbort:
        return invalid("request", f"is not a valid {self.message_type} message")


class RequestDecoding(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the Bridge method's message reach the method as Undecodable,
    which it answers with INVALID_ARGUMENT (grpc itself would answer UNKNOWN or INTERNAL)."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        prefix = f"/{SERVICE}/"
        if handler is None or not details.method.startswith(prefix) or handler.request_deserializer is None:
            return handler
        method = pb.DESCRIPTOR.services_by_name["Bridge"].methods_by_name.get(details.method[len(prefix):])
        message_type = method.input_type.full_name if method is not None else "request"
        deserialize = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception:  # noqa: BLE001 (any decoding failure is the client's bytes)
                return Undecodable(message_type)

        return handler._replace(request_deserializer=tolerant)


# -- authentication ------------------------------------------------------------------------------------

class TokenAuth(grpc.aio.ServerInterceptor):
    """Every call but the health service must carry ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    err = RpcAbort(grpc.StatusCode.UNAUTHENTICATED, "token: missing or wrong bearer token", "UNAUTHENTICATED", "token")

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


# -- connections per peer --------------------------------------------------------------------------------

class PeerConnections(grpc.aio.ServerInterceptor):
    """At most ``cap`` connections of one host with calls in flight; a call that would open one
    more is refused with RESOURCE_EXHAUSTED (the health service is never refused).

    gRPC shows a server no connection, only calls and their peer (``ipv4:HOST:PORT``: one
    connection each), so a connection counts while it has a call in flight. A connection with
    none is closed by the server's idle limit, and one that never starts HTTP/2 by its handshake
    timeout (:func:`connection_options`)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._calls: collections.Counter[str] = collections.Counter()          # peer -> calls in flight
        self._hosts: dict[str, set[str]] = collections.defaultdict(set)        # host -> its peers with calls

    def _enter(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0]
        peers = self._hosts[host]
        if peer not in peers and len(peers) >= self.cap:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"connections: {host} already has {len(peers)} connections with calls in flight "
                           f"(this server's limit); use fewer channels", "TOO_MANY_CONNECTIONS")
        peers.add(peer)
        self._calls[peer] += 1

    def _leave(self, peer: str) -> None:
        self._calls[peer] -= 1
        if self._calls[peer] <= 0:
            del self._calls[peer]
            host = peer.rsplit(":", 1)[0]
            self._hosts[host].discard(peer)
            if not self._hosts[host]:
                del self._hosts[host]

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """The call's peer, let in (counted until :meth:`_leave`), or the call aborted with why not."""
        peer = context.peer()
        try:
            self._enter(peer)
        except RpcAbort as err:
            await context.abort(err.code, err.message, trailing_metadata=err.trailing_metadata())
        return peer

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary or handler.stream_unary:
            behavior = handler.unary_unary or handler.stream_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                peer = await self._admit(context)
                try:
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result
                finally:
                    self._leave(peer)

            make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            return make(unary, **kw)
        behavior = handler.unary_stream or handler.stream_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            peer = await self._admit(context)
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):             # a handler that writes with context.write
                    await result
                    return
                async for item in result:
                    yield item
            finally:
                self._leave(peer)

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(stream, **kw)
