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

`run_server` puts a request boundary (`rollout._grpc_server`) in front of the orchestrator,
because anything that fails in a driver thread kills the process: every `Decode` request is
checked (`check_request`: a prompt, token ids inside the model's vocabulary, text the tokenizer can
encode, a length that fits the prefill, `max_tokens >= 1`; a body that does not parse, e.g.
invalid UTF-8, too) and refused with INVALID_ARGUMENT before a thread sees it; requests past the
driver's `max_requests` in flight get RESOURCE_EXHAUSTED; with an auth token, calls without
`authorization: Bearer <token>` metadata get UNAUTHENTICATED.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
from typing import Any

import jax
import numpy as np

from ._engine import Engine
from ._grpc_server import (RequestLimits, Server, bearer_auth, check_request, is_loopback,
                           make_servicer)

__all__ = ["import_jetstream", "as_jetstream_engine", "make_driver", "run_server", "Server",
           "RequestLimits", "check_request", "is_loopback"]


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
    interceptors = () if auth_token is None else (bearer_auth(auth_token),)
    name = host.strip("[]")
    address = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    # as 0.2.2's server_lib: enough handler threads to keep every decode slot busy
    threads = threads or max(engine.max_concurrent_decodes, 64)
    return Server(js, driver, servicer, address=address, credentials=credentials,
                  interceptors=interceptors, threads=threads)
