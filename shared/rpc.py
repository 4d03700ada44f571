"""gRPC behind one seam: an asyncio server with health and reflection, and client helpers.

Trace context rides in gRPC metadata (`traceparent`), so a span started by a
client continues in the server that answers it.

Security (`Security`, from settings): with `CRUCIBLE_RPC_TOKEN` set, every server refuses a call
without `authorization: Bearer <token>` (UNAUTHENTICATED), health checks aside (probes carry no
token), and every client sends it; with `CRUCIBLE_RPC_TLS_CERT`/`_KEY` the servers speak TLS, and
clients trust `CRUCIBLE_RPC_TLS_CA`. Off by default on 127.0.0.1; a server asked to listen beyond
loopback without a token refuses to start (unless `CRUCIBLE_RPC_ALLOW_INSECURE`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context
from opentelemetry import trace

from crucible.shared import procs, telemetry
from crucible.shared.settings import shown_url

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 32 * 1024 * 1024
# Probes carry no token: a health Check answers at once. A Watch stream stays open, and needs the token (3,000
# held without one cost a server 19 MB, and every one would hold a slot of MAX_CALLS).
UNGUARDED = ("/grpc.health.v1.Health/Check",)
MAX_CALLS = 4096  # calls under way in one server, past which gRPC answers RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Security:
    token: str = ""
    tls_cert: bytes = b""
    tls_key: bytes = b""
    tls_ca: bytes = b""
    allow_insecure: bool = False

    @classmethod
    def of(cls, settings=None) -> "Security":
        if settings is None:
            from crucible.shared.settings import get_settings

            settings = get_settings()

        def read(path) -> bytes:
            return path.read_bytes() if path else b""

        return cls(token=settings.rpc_token.get_secret_value() if settings.rpc_token else "",
                   tls_cert=read(settings.rpc_tls_cert), tls_key=read(settings.rpc_tls_key),
                   tls_ca=read(settings.rpc_tls_ca), allow_insecure=settings.rpc_allow_insecure)


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call whose metadata lacks the bearer token; health checks pass."""

    def __init__(self, token: str):
        self.expected = token.encode()

    def _allowed(self, metadata) -> bool:
        """One authorization header, `Bearer <token>` (the scheme in any case, RFC 6750); two are refused
        whatever they say (the first one decided, so a right token before a wrong one passed)."""
        given = [m.value for m in metadata or () if m.key == "authorization"]
        if len(given) != 1:
            return False
        value = given[0].encode() if isinstance(given[0], str) else given[0]
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNGUARDED):
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler
        kind = next(k for k in _TracingInterceptor._KINDS if getattr(handler, k) is not None)

        async def refuse(requests, context):
            await abort(context, grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token (set CRUCIBLE_RPC_TOKEN to the deployment's)")

        # Refused as a call that streams its requests, whatever the method's kind: the refusal reads none of
        # them. A unary handler is called with its request received whole: 24 callers without a token,
        # sending 30 MB each, took the server from 59 MB to 950 MB before any was refused. Nothing of an
        # unauthenticated caller's message is parsed either (no deserializer), however large or deep.
        streamed = "stream_" + kind.split("_", 1)[1]
        return getattr(grpc, f"{streamed}_rpc_method_handler")(
            refuse, request_deserializer=None, response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class Service:
    """One servicer to mount: `add` is the generated add_XServicer_to_server function."""

    name: str  # full service name, e.g. "crucible.v1.Sandbox"
    servicer: object
    add: Callable[[object, grpc.aio.Server], None]


class _TracingInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace: each RPC, unary or streaming, runs in a SERVER span parented by its metadata."""

    _KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        kind = next(k for k in self._KINDS if getattr(handler, k) is not None)
        carrier = [(m.key, m.value) for m in (handler_call_details.invocation_metadata or ())]
        traced = _traced(_checked(getattr(handler, kind), kind), handler_call_details.method.lstrip("/"),
                         telemetry.extract_context(carrier))
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            traced, request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class _Undecodable:
    reason: str


def _tolerant(deserialize):
    """Request bytes that do not parse become an _Undecodable (answered INVALID_ARGUMENT by _checked),
    instead of the UNKNOWN gRPC makes of a deserializer's exception."""
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # any input: a DecodeError, a RecursionError, ...
            return _Undecodable(f"{type(exc).__name__}: {str(exc)[:200]}")

    return parse


def _checked(inner, kind: str):
    """`inner`, answering INVALID_ARGUMENT for a request (or a streamed request) that did not parse, and
    INTERNAL for what a handler raised without answering (_unanswered)."""
    message = "the request bytes are not a valid message for this method"

    async def refuse(context, bad: _Undecodable):
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{message} ({bad.reason})")

    if kind.startswith("stream"):
        async def checked_stream(requests, context):
            async def clean():
                async for r in requests:
                    if isinstance(r, _Undecodable):
                        await refuse(context, r)
                    yield r
            return clean()

        if inspect.isasyncgenfunction(inner):
            async def streamed(requests, context):
                try:
                    async for reply in inner(await checked_stream(requests, context), context):
                        yield reply
                except Exception as exc:  # noqa: BLE001
                    await _unanswered(context, exc)
            return streamed

        async def unary_reply(requests, context):
            try:
                return await inner(await checked_stream(requests, context), context)
            except Exception as exc:  # noqa: BLE001
                await _unanswered(context, exc)
        return unary_reply

    if inspect.isasyncgenfunction(inner):
        async def streamed_one(request, context):
            if isinstance(request, _Undecodable):
                await refuse(context, request)
            try:
                async for reply in inner(request, context):
                    yield reply
            except Exception as exc:  # noqa: BLE001
                await _unanswered(context, exc)
        return streamed_one

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await refuse(context, request)
        try:
            return await inner(request, context)
        except Exception as exc:  # noqa: BLE001
            await _unanswered(context, exc)
    return unary


async def _unanswered(context, exc: Exception) -> None:
    """A handler's exception that is not an answer (an abort is one): logged here, whole, under an id, and
    the caller told INTERNAL with that id and nothing of the error. gRPC's own answer was UNKNOWN with the
    exception's text, which tells a caller a store's host and port, paths, or whatever else it held."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    incident = uuid.uuid4().hex[:12]
    log.error("a call failed without an answer (incident %s)", incident, exc_info=exc)
    await abort(context, grpc.StatusCode.INTERNAL, f"the service failed on this call (incident {incident}, in "
                "its log); try again, and report it if it persists")


def _traced(inner, method: str, parent):
    """`inner` wrapped in a SERVER span; a handler that streams replies keeps its span until the last one."""
    tracer = telemetry.tracer("crucible.rpc")

    def start():
        span = tracer.start_span(method, context=parent, kind=trace.SpanKind.SERVER)
        span.set_attribute("rpc.system", "grpc")
        return span

    if inspect.isasyncgenfunction(inner):
        async def streamed(request, context):
            span = start()
            replies = inner(request, context)
            try:
                while True:
                    token = otel_context.attach(trace.set_span_in_context(span))
                    try:
                        reply = await replies.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        otel_context.detach(token)
                    yield reply
            finally:
                await replies.aclose()
                span.end()
        return streamed

    async def unary(request, context):
        span = start()
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            return await inner(request, context)
        finally:
            otel_context.detach(token)
            span.end()
    return unary


# Readiness probes of the broker and the store: a TCP connection each time, which costs the prober and the
# dependency about 1 ms of CPU together (a broker and a store probed by five services here, every second:
# about 7 ms of CPU a second on a 2-core machine). While all answer, a lapse is noticed within
# DEPENDENCY_PROBE_UP_S (a Kubernetes readiness probe asks every 10 s by default); while one does not,
# its return within DEPENDENCY_PROBE_S.
DEPENDENCY_PROBE_S = 1.0
DEPENDENCY_PROBE_UP_S = 4.0


async def _answers(address: str, timeout: float = 1.0) -> bool:
    """Whether `address` accepts a TCP connection (any entry of a comma-separated list: a bootstrap
    list is up while one broker answers); without blocking the loop."""
    from crucible.shared.procs import host_port

    for entry in address.split(",") if "://" not in address else [address]:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*host_port(entry)), timeout)
        except (OSError, ValueError, asyncio.TimeoutError):
            continue
        writer.close()
        return True
    return False


class RpcServer:
    """A grpc.aio server exposing `services` plus grpc.health.v1 and reflection."""

    def __init__(self, services: Sequence[Service], host: str = "127.0.0.1", port: int = 0,
                 security: Security | None = None, depends_on: Sequence[tuple[str, str]] = ()):
        """`depends_on`: (name, address) of what the service cannot work without (the broker, the
        store): while one does not answer, every health status here is NOT_SERVING."""
        security = security or Security.of()
        self.depends_on = list(depends_on)
        self.unreachable: dict[str, str] = {}  # dependency -> its address, while it does not answer
        self._probe: asyncio.Task | None = None
        if not security.token and not procs.loopback(host) and not security.allow_insecure:
            raise PermissionError(f"refusing to serve gRPC on {host} without a token: set CRUCIBLE_RPC_TOKEN (and "
                                  "CRUCIBLE_RPC_TLS_CERT/KEY), or CRUCIBLE_RPC_ALLOW_INSECURE=1 on a trusted network")
        self.services = list(services)
        self.server = grpc.aio.server(
            interceptors=[*([_AuthInterceptor(security.token)] if security.token else []), _TracingInterceptor()],
            maximum_concurrent_rpcs=MAX_CALLS,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # A port another server holds is an error here, not a port shared with it: with gRPC's
                # default SO_REUSEPORT, a run's generator and verifier once both bound one port, and
                # half the calls for either went to the other (NOT_FOUND) without a word.
                ("grpc.so_reuseport", 0),
            ],
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in self.services:
            service.add(service.servicer, self.server)
        names = [s.name for s in self.services] + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                    reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        try:
            if security.tls_cert:
                credentials = grpc.ssl_server_credentials([(security.tls_key, security.tls_cert)])
                self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
            else:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpcio raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind gRPC on {host}:{port}: is the port taken?")
        self.address = f"{host}:{self.port}"

    async def start(self) -> "RpcServer":
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC serving %s on %s", [s.name for s in self.services], self.address)
        if self.depends_on:
            self._probe = asyncio.create_task(self._watch_dependencies())
        return self

    async def _set_health(self, status) -> None:
        for name in ["", *(s.name for s in self.services)]:
            await self.health.set(name, status)

    async def _watch_dependencies(self) -> None:
        """Readiness: NOT_SERVING while a dependency does not accept connections, SERVING once all do."""
        while True:
            down = {}
            for name, address in self.depends_on:
                try:
                    if not await _answers(address):
                        down[name] = address
                except Exception as exc:  # the probe must not die and freeze readiness where it was
                    log.warning("readiness probe of %s at %s failed: %s", name, shown_url(address), exc)
            if down and not self.unreachable:
                log.warning("not ready: %s not answering", ", ".join(f"{n} at {shown_url(a)}" for n, a in down.items()))
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            elif self.unreachable and not down:
                log.info("ready again: %s answering", ", ".join(self.unreachable))
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self.unreachable = down
            await asyncio.sleep(DEPENDENCY_PROBE_S if down else DEPENDENCY_PROBE_UP_S)

    async def stop(self, grace: float = 2.0) -> None:
        if self._probe:
            self._probe.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def __aenter__(self) -> "RpcServer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def _with_trace_context(client_call_details, token: str = ""):
    metadata = list(client_call_details.metadata or []) + telemetry.inject_metadata()
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    return grpc.aio.ClientCallDetails(client_call_details.method, client_call_details.timeout, metadata,
                                      client_call_details.credentials, client_call_details.wait_for_ready)


# One class per call kind: grpc.aio files each interceptor under the first kind it implements.
class _Metadata:
    def __init__(self, token: str = ""):
        self.token = token

    def details(self, client_call_details):
        return _with_trace_context(client_call_details, self.token)


class _UnaryUnaryTracing(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _UnaryStreamTracing(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _StreamUnaryTracing(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self.details(client_call_details), request_iterator)


class _StreamStreamTracing(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self.details(client_call_details), request_iterator)


def channel(target: str, security: Security | None = None) -> grpc.aio.Channel:
    """An asyncio channel that propagates the current trace context and, where the deployment has
    them (Security.of(settings)), sends its token and speaks TLS."""
    security = security or Security.of()
    interceptors = [cls(security.token) for cls in (_UnaryUnaryTracing, _UnaryStreamTracing, _StreamUnaryTracing,
                                                    _StreamStreamTracing)]
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    if security.tls_ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=security.tls_ca)
        return grpc.aio.secure_channel(target, credentials, interceptors=interceptors, options=options)
    return grpc.aio.insecure_channel(target, interceptors=interceptors, options=options)


async def health_status(target: str, service: str = "", timeout: float = 5.0,
                        security: Security | None = None) -> str:
    """The grpc.health.v1 status name ('SERVING', 'NOT_SERVING', ...) of `service` at `target`."""
    async with channel(target, security) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_serving(target: str, service: str = "", timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    last: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            if await health_status(target, service, timeout=1.0) == "SERVING":
                return
        except grpc.aio.AioRpcError as exc:
            last = exc
        await asyncio.sleep(0.1)
    raise TimeoutError(f"gRPC {service or 'server'} at {target} not SERVING after {timeout:.0f}s: {last}")


# A status message travels in the trailers, which a client takes up to 8 KiB of (in all, escaped):
# a longer one (a 20,000-character id quoted, 300 tasks' problems joined) reached the caller as
# RESOURCE_EXHAUSTED instead of what it said.
MAX_STATUS_MESSAGE = 2000


class Admission:
    """At most `limit` units of work (calls, or the requests they carry) under way in a servicer's calls;
    a call past that is RESOURCE_EXHAUSTED at once, never queued: a flood of calls otherwise waited
    without bound, holding their requests in memory and work meant for the service's own traffic."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what, self.taken = limit, what, 0

    @contextlib.asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext, units: int = 1):
        if self.taken + units > self.limit:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.taken} {self.what} under way here (at most {self.limit}): retry with backoff")
        self.taken += units
        try:
            yield
        finally:
            self.taken -= units


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str):
    """Ends the call with `code` and `message`, cut to MAX_STATUS_MESSAGE characters (marked where cut):
    every server of Crucible ends a call through here."""
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[:MAX_STATUS_MESSAGE - 40] + f" ... ({len(message)} characters in all)"
    await context.abort(code, message)


async def abort_invalid(context: grpc.aio.ServicerContext, message: str):
    """Ends the call with INVALID_ARGUMENT and a message a caller can act on."""
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, message)
