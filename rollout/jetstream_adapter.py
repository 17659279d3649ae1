"""Serve a `rollout.Engine` through JetStream 0.2.2's orchestrator and gRPC server.

This is the only module that imports `jetstream` (the `jetstream` extra: `google-jetstream==0.2.2`,
which pulls seqio and TensorFlow), and only when its functions are called. `import_jetstream()`
applies the two fixes 0.2.2 needs on current JAX:
- `orchestrator.delete_pytree` calls `jax.tree_map` (removed from JAX): the generate thread would
  die and the process be killed. We replace it with a `jax.tree.map` version.
- importing the orchestrator sets the root logger to DEBUG and adds a stdout handler: we restore
  the root logger's level and handlers.
0.2.2 also prepends `bos_id` to every request; for models without a BOS token the patched
`Driver` prepends nothing, so served prompts are the tokens sent (as the trainer's engine sees them).
Every driver thread is a `JetThread`, which SIGKILLs the whole process on any exception. Two
0.2.2 races raise there, and `import_jetstream()` fixes both:
- after filling slots, the generate thread asserts that some slot is in use, but the detokenize
  thread may free the last one in between. `orchestrator.Driver` becomes a subclass whose
  generate thread restarts instead, which is safe because at that moment no request holds a slot;
- a request's `AsyncMultifuture.close()` posts two callbacks to the receiver's event loop. The
  receiver can finish after the first one and close its loop (e.g. `asyncio.run` returning), and
  the second one then raises "Event loop is closed". Results posted to a closed loop are now
  dropped, since nobody is left to read them.

`run_server` puts a request boundary in front of the orchestrator, because anything that fails in
a driver thread kills the process: every `Decode` request is checked (`check_request`: a prompt,
token ids inside the model's vocabulary, text the tokenizer can encode, a length that fits the
prefill, `max_tokens >= 1`; a body that does not parse, e.g. invalid UTF-8, too) and refused with
INVALID_ARGUMENT before a thread sees it; requests past `max_requests` in flight get
RESOURCE_EXHAUSTED; with an auth token, calls without `authorization: Bearer <token>` metadata get
UNAUTHENTICATED.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import logging
import queue
import threading
from concurrent import futures
from typing import Any, Callable

import jax
import numpy as np

from ._engine import Engine


@functools.lru_cache(maxsize=1)
def import_jetstream():
    """Imports and patches jetstream; returns a namespace of its modules we use."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.core import config_lib, orchestrator, server_lib
        from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("serving through JetStream needs the `jetstream` extra: "
                          "pip install 'google-jetstream==0.2.2'") from e
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)

    def delete_pytree(p):
        def delete_leaf(leaf):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        jax.tree.map(delete_leaf, p)

    orchestrator.delete_pytree = delete_pytree
    if not getattr(orchestrator.Driver, "_jaxrl_llm_patched", False):
        orchestrator.Driver = _patch_driver(orchestrator.Driver)
    from jetstream.core.utils import async_multifuture
    future_cls = async_multifuture.AsyncMultifuture
    for name in ("add_result", "set_exception"):
        fn = getattr(future_cls, name)
        if not getattr(fn, "_jaxrl_llm_patched", False):
            setattr(future_cls, name, _drop_if_loop_closed(fn))

    class NS:
        pass

    ns = NS()
    for name, mod in dict(config_lib=config_lib, orchestrator=orchestrator, server_lib=server_lib,
                          jetstream_pb2=jetstream_pb2, jetstream_pb2_grpc=jetstream_pb2_grpc,
                          engine_api=engine_api, token_utils=token_utils,
                          tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2).items():
        setattr(ns, name, mod)
    return ns


def _drop_if_loop_closed(method):
    """An `AsyncMultifuture` method that does nothing once the receiver's event loop is closed."""

    @functools.wraps(method)
    def wrapper(self, *args):
        try:
            return method(self, *args)
        except RuntimeError:
            if self._loop.is_closed():  # noqa: SLF001 - the receiver is gone
                return None
            raise

    wrapper._jaxrl_llm_patched = True
    return wrapper


def _patch_driver(base):
    """`base` (0.2.2's Driver) with a generate thread that restarts after the all-slots-free race."""

    class Driver(base):
        """0.2.2's Driver, plus: at most `max_requests` requests admitted and not yet finished
        (None: no bound); past it `place_request_on_prefill_queue` raises `queue.Full`, which the
        orchestrator answers with RESOURCE_EXHAUSTED."""

        _jaxrl_llm_patched = True

        def __init__(self, *args, max_requests: int | None = None, **kwargs):
            self.max_requests = max_requests
            self.in_flight = 0  # admitted requests whose return channel is not closed yet
            self.admission = threading.Condition()
            super().__init__(*args, **kwargs)

        def place_request_on_prefill_queue(self, request):
            with self.admission:
                if self.max_requests is not None and self.in_flight >= self.max_requests:
                    raise queue.Full
                self.in_flight += 1
                self.admission.notify_all()
            channel = request.return_channel
            close = channel.close

            def close_and_release():  # the detokenize thread closes a request when it is done
                try:
                    close()
                finally:
                    self._release()

            channel.close = close_and_release
            try:
                super().place_request_on_prefill_queue(request)
            except BaseException:
                self._release()
                raise

        def _release(self):
            with self.admission:
                self.in_flight -= 1
                self.admission.notify_all()

        def _generate_thread(self, idx: int):
            slots = self._generate_slots[idx]
            while True:
                try:
                    return super()._generate_thread(idx)
                except AssertionError:
                    # Only this thread takes slots, so a full queue now means it was full at the
                    # assertion: no request is being decoded and the decode state holds nothing.
                    if slots.qsize() != self._generate_engines[idx].max_concurrent_decodes:
                        raise
                    if not self.live:
                        return None
                    logging.getLogger(__name__).info(
                        "generate thread %d: every slot was freed during a step; restarting", idx)

        def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
            # 0.2.2 prepends tokenizer.bos_id to every new request; a model without a BOS token
            # (Qwen2.5, the char tokenizer) must get its prompt as sent, like the trainer's engine
            if not getattr(tokenizer, "adds_bos", True):
                is_bos = False
                if not isinstance(request.prefill_content, str):  # pad_tokens needs an array then
                    request.prefill_content = np.asarray(request.prefill_content, np.int32)
            return super()._process_prefill_content(request, tokenizer, is_bos, max_prefill_length)

    return Driver


def _make_tokenizer(js, engine: Engine):
    """A `jetstream.engine.tokenizer_api.Tokenizer` over the engine's tokenizer (or ids only)."""
    inner = engine.tokenizer
    bos = engine.config.bos_token_id
    if bos is None:
        bos = getattr(inner, "bos_token_id", None)

    class Tokenizer(js.tokenizer_api.Tokenizer):
        adds_bos = bos is not None  # read by the patched Driver: no BOS token, nothing prepended

        def encode(self, s: str, **kwargs):
            if inner is None:
                raise ValueError("this engine has no tokenizer: send token_content, not text")
            ids = np.asarray(inner.encode(s), np.int32)
            return js.token_utils.pad_tokens(
                ids, self.bos_id, self.pad_id, is_bos=kwargs.get("is_bos", True) and bos is not None,
                max_prefill_length=kwargs.get("max_prefill_length"),
                jax_padding=kwargs.get("jax_padding", True))

        def decode(self, token_ids, **kwargs) -> str:
            if inner is None:
                return " ".join(str(t) for t in token_ids)
            return inner.decode(list(token_ids))

        @property
        def pad_id(self) -> int:
            return engine.pad_token_id

        @property
        def eos_id(self) -> int:
            return engine.stop_token_ids[0] if engine.stop_token_ids else -1

        @property
        def bos_id(self) -> int:
            # JetStream's API needs an int; for a model without a BOS token nothing is prepended
            # (`adds_bos` False), so the pad id reported here is never sent to the model.
            return engine.pad_token_id if bos is None else int(bos)

        @property
        def stop_tokens(self) -> set[int]:
            return set(engine.stop_token_ids)

    return Tokenizer()


def as_jetstream_engine(engine: Engine):
    """Wraps `engine` as a `jetstream.engine.engine_api.Engine` (same decode state and params)."""
    js = import_jetstream()
    tokenizer = _make_tokenizer(js, engine)

    class JetStreamEngine(js.engine_api.Engine):
        def __init__(self):
            self.engine = engine

        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
            return engine.prefill(params=params, existing_prefix=existing_prefix,
                                  padded_tokens=padded_tokens, true_length=true_length)

        def prefill_multisampling(self, **kw):
            return engine.prefill_multisampling(**kw)

        def insert(self, prefix, decode_state, slot):
            return engine.insert(prefix, decode_state, slot)

        def bulk_insert(self, prefix, decode_state, slots):
            return engine.bulk_insert(prefix, decode_state, slots)

        def free_resource(self, decode_state, slot):
            return engine.free_resource(decode_state, slot)

        def generate(self, params, decode_state):
            state, result = engine.generate(params, decode_state)
            return state, js.engine_api.ResultTokens(
                data=result.data, tokens_idx=result.tokens_idx, valid_idx=result.valid_idx,
                length_idx=result.length_idx, samples_per_slot=result.samples_per_slot)

        def load_params(self, *args, **kwargs):
            return engine.load_params()

        def init_decode_state(self, *args, **kwargs):
            return engine.init_decode_state()

        def get_prefix_destination_sharding(self):
            return engine.get_prefix_destination_sharding()

        def get_tokenizer(self):
            return js.tokenizer_pb2.TokenizerParameters(path="")

        def build_tokenizer(self, metadata):
            return tokenizer

        max_concurrent_decodes = property(lambda self: engine.max_concurrent_decodes)
        samples_per_slot = property(lambda self: engine.samples_per_slot)
        max_prefill_length = property(lambda self: engine.max_prefill_length)
        mesh = property(lambda self: engine.mesh)
        colocated_cpus = property(lambda self: engine.colocated_cpus)

    return JetStreamEngine()


def make_driver(engine: Engine, *, max_requests: int | None = None):
    """An in-process JetStream `orchestrator.Driver` (interleaved mode) serving `engine`; at most
    `max_requests` requests in flight (None: no bound)."""
    js = import_jetstream()
    jse = as_jetstream_engine(engine)
    params = jse.load_params()
    return js.orchestrator.Driver(prefill_engines=[jse], generate_engines=[jse],
                                  prefill_params=[params], generate_params=[params],
                                  interleaved_mode=True, max_requests=max_requests)


# ------------------------------------------------------------------------- the request boundary
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


def _bearer_auth(token: str):
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
            server = grpc.aio.server(self._executor, interceptors=list(interceptors))
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


def run_server(engine: Engine, port: int, *, host: str = "127.0.0.1", credentials: Any = None,
               threads: int | None = None, auth_token: str | None = None, insecure: bool = False,
               max_queued_requests: int | None = 64) -> Server:
    """Serves `engine` with JetStream's orchestrator over gRPC on `host:port`; returns the `Server`.

    Binds loopback by default. A host other than loopback needs `auth_token` (checked on every
    call) or `insecure=True`. credentials None: gRPC local credentials on loopback, plaintext
    elsewhere (put TLS in front, e.g. a proxy, on an untrusted network). At most
    `max_concurrent_decodes + max_queued_requests` requests are in flight (None: no bound).
    """
    import grpc
    if auth_token is not None and not auth_token:
        raise ValueError("auth_token is empty: pass a non-empty token or None")
    if not is_loopback(host) and auth_token is None and not insecure:
        raise ValueError(f"host {host!r} is not a loopback address: pass auth_token, or "
                         "insecure=True to serve it without authentication")
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0 or None, got {max_queued_requests}")
    js = import_jetstream()
    if credentials is None:
        credentials = (grpc.local_server_credentials() if is_loopback(host)
                       else grpc.insecure_server_credentials())
    bound = None if max_queued_requests is None else (
        engine.max_concurrent_decodes + max_queued_requests)
    driver = make_driver(engine, max_requests=bound)
    servicer = make_servicer(js, driver, RequestLimits.of(engine))
    interceptors = () if auth_token is None else (_bearer_auth(auth_token),)
    name = host.strip("[]")
    address = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    # as 0.2.2's server_lib: enough handler threads to keep every decode slot busy
    threads = threads or max(engine.max_concurrent_decodes, 64)
    return Server(js, driver, servicer, address=address, credentials=credentials,
                  interceptors=interceptors, threads=threads)
