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
"""
from __future__ import annotations

import functools
import logging
from typing import Any

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
        _jaxrl_llm_patched = True

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


def make_driver(engine: Engine):
    """An in-process JetStream `orchestrator.Driver` (interleaved mode) serving `engine`."""
    js = import_jetstream()
    jse = as_jetstream_engine(engine)
    params = jse.load_params()
    return js.orchestrator.Driver(prefill_engines=[jse], generate_engines=[jse],
                                  prefill_params=[params], generate_params=[params],
                                  interleaved_mode=True)


def run_server(engine: Engine, port: int, *, host: str = "127.0.0.1", credentials: Any = None,
               threads: int | None = None):
    """Starts JetStream's gRPC server (server_lib.run) for `engine` on `host:port`.

    Binds loopback by default (0.2.2 binds every interface; we narrow it). Returns the
    `JetStreamServer`; call `.stop()` to shut it down.
    """
    js = import_jetstream()
    import dataclasses

    import grpc

    jse = as_jetstream_engine(engine)

    @dataclasses.dataclass
    class Config(js.config_lib.ServerConfig):
        interleaved_slices: tuple = ("cpu=1",)
        interleaved_engine_create_fns: tuple = (lambda devices: jse,)

    js.server_lib._HOST = host  # noqa: SLF001 - 0.2.2 has no host argument
    if credentials is None:
        credentials = grpc.local_server_credentials()
    return js.server_lib.run(port=port, config=Config, devices=[None], credentials=credentials,
                             threads=threads)
