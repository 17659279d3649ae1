"""The gRPC side of `rollout.jetstream_adapter.run_server`: the request boundary and the server.

JetStream 0.2.2's driver threads SIGKILL the process on any exception, and its
`server_lib.JetStreamServer` can add neither interceptors nor a servicer of our own. Here:
`check_request` (what a `DecodeRequest` must satisfy, one line naming the problem), the servicer
that refuses bad requests (INVALID_ARGUMENT) and overload (RESOURCE_EXHAUSTED) before the
orchestrator queues them, a bearer-token interceptor (UNAUTHENTICATED), and `Server` (the gRPC
aio server on its own event-loop thread). Nothing here imports jetstream: its modules come in as
`js` (`jetstream_adapter.import_jetstream()`), and grpc (the `jetstream` extra pulls it in) only
when a function here is called.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import threading
from concurrent import futures
from typing import Any, Callable

from ._engine import Engine


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a `DecodeRequest` must satisfy for `engine` (see `check_request`)."""

    vocab_size: int
    max_prefill_length: int
    adds_bos: bool  # one token is prepended to every prompt
    encode: Callable[[str], Any] | None  # the tokenizer's encode; None: token_content only

    @classmethod
    def of(cls, engine: Engine) -> "RequestLimits":
        tokenizer = engine.tokenizer
        bos = engine.config.bos_token_id
        if bos is None:
            bos = getattr(tokenizer, "bos_token_id", None)
        return cls(vocab_size=int(engine.config.vocab_size),
                   max_prefill_length=int(engine.max_prefill_length), adds_bos=bos is not None,
                   encode=None if tokenizer is None else tokenizer.encode)


def check_request(request, limits: RequestLimits) -> str | None:
    """The problem with a `DecodeRequest` (one line naming the field), or None when it can be served.

    Everything the orchestrator's threads would die on, or silently get wrong, is refused here.
    """
    which = request.WhichOneof("content")
    if which is None:
        return "DecodeRequest has no prompt: set text_content or token_content"
    if request.max_tokens < 1:
        return f"max_tokens must be >= 1 (tokens to generate), got {request.max_tokens}"
    if request.session_cache:
        return "session_cache is not supported by this server: leave it empty"
    if which == "text_content":
        if not request.text_content.text:
            return "empty prompt: text_content.text is empty"
        if limits.encode is None:
            return "this server has no tokenizer: send token_content (token ids), not text_content"
        try:
            ids = [int(t) for t in limits.encode(request.text_content.text)]
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is the request's problem
            return f"text_content cannot be tokenized by the checkpoint's tokenizer: {e}"
        field = "text_content (after tokenization)"
    else:
        ids = list(request.token_content.token_ids)
        field = "token_content.token_ids"
    if not ids:
        return f"empty prompt: {field} has no tokens"
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        return (f"{field}: token id {ids[bad]} at position {bad} is outside the model's vocabulary "
                f"[0, {limits.vocab_size})")
    n = len(ids) + int(limits.adds_bos)
    if n > limits.max_prefill_length:
        return (f"prompt of {n} tokens is longer than the server's max prefill length "
                f"{limits.max_prefill_length} (--max-prefill-length): shorten it")
    return None


class _Unparsable:
    """Stands in for a request body that is not a DecodeRequest (e.g. text that is not UTF-8)."""

    def __init__(self, error: Exception):
        self.problem = f"the request is not a valid DecodeRequest ({error})"


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError; refused in Decode
            return _Unparsable(e)
    return parse


async def _abort(context, code, details: str):
    if context is None:  # called in-process, as LLMOrchestrator allows
        raise ValueError(details)
    await context.abort(code, details)


def make_servicer(js, driver, limits: RequestLimits):
    """JetStream's `LLMOrchestrator` over `driver`, refusing bad requests and overload first."""
    import grpc

    class Orchestrator(js.orchestrator.LLMOrchestrator):
        async def Decode(self, request, context=None):  # noqa: N802 - the gRPC method name
            if isinstance(request, _Unparsable):
                problem = request.problem
            else:
                problem = check_request(request, limits)
            if problem is not None:
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
            bound = driver.max_requests
            if bound is not None and driver.in_flight >= bound:
                # the driver's own check is the exact one; this one only gives the clearer message
                await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the server is busy: {bound} requests in flight (--slots + "
                             f"--max-queued-requests); retry later")
            async for response in super().Decode(request, context):
                yield response

    return Orchestrator(driver=driver)


def _add_servicer(js, servicer, server):
    """Like jetstream_pb2_grpc.add_OrchestratorServicer_to_server, with a Decode body that does
    not parse reaching `Decode` (to be refused with INVALID_ARGUMENT) instead of gRPC's INTERNAL."""
    import grpc
    pb = js.jetstream_pb2
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=_lenient(pb.DecodeRequest),
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("jetstream_proto.Orchestrator", handlers),))


def bearer_auth(token: str):
    """A gRPC aio server interceptor: calls without metadata `authorization: Bearer <token>` are
    answered UNAUTHENTICATED (constant-time comparison)."""
    import grpc

    expected = f"Bearer {token}".encode()
    details = "missing or wrong token: send gRPC metadata 'authorization: Bearer <token>'"

    async def deny_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # an async generator, as a streaming handler must be

    class BearerAuth(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, call_details):
            metadata = dict(call_details.invocation_metadata or ())
            sent = metadata.get("authorization", "")
            sent = sent.encode() if isinstance(sent, str) else bytes(sent)
            handler = await continuation(call_details)
            if handler is None or hmac.compare_digest(sent, expected):
                return handler
            if handler.response_streaming:
                return grpc.unary_stream_rpc_method_handler(deny_stream)
            return grpc.unary_unary_rpc_method_handler(deny_unary)

    return BearerAuth()


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (127.x, ::1, localhost)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: assume it is reachable from elsewhere
        return False


class Server:
    """JetStream's Orchestrator gRPC service for one `Driver`, on its own event-loop thread
    (like 0.2.2's `server_lib.JetStreamServer`, which has no way to add interceptors or a
    servicer of our own). `port` is the bound port; `.stop()` shuts everything down."""

    def __init__(self, js, driver, servicer, *, address: str, credentials, interceptors=(),
                 threads: int):
        import grpc
        self.driver = driver
        self._executor = futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="jetstream-grpc",
                                        daemon=True)
        self._thread.start()

        async def start():
            # no SO_REUSEPORT: a second server on a port in use is an error, not a silent sharer
            server = grpc.aio.server(self._executor, interceptors=list(interceptors),
                                     options=[("grpc.so_reuseport", 0)])
            _add_servicer(js, servicer, server)
            try:
                port = server.add_secure_port(address, credentials)
            except RuntimeError as e:
                raise OSError(f"cannot listen on {address}: {e}") from None
            await server.start()
            return server, port

        try:
            self._grpc, self.port = self._call(start())
        except BaseException:
            self._shutdown_loop()
            raise

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _shutdown_loop(self):
        self.driver.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._executor.shutdown(wait=False)

    def stop(self, grace: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._grpc.stop(grace=grace))
        self._shutdown_loop()

    def wait_for_termination(self) -> None:
        try:
            self._call(self._grpc.wait_for_termination())
        finally:
            self.stop()
