"""Rollout: a JetStream-API generation engine, the RL batch driver, sampling and weight sync.

- `Engine`: prefill / insert / generate over our Flax `CausalLM` with a KV cache in the decode
  state (JetStream 0.2.2's `Engine` API plus bulk_insert, prefill_multisampling, free_resource and
  per-token log-probs); `Engine.from_model`, `Engine.from_pretrained`; `engine.update_params`
  (zero-copy or one reshard); `layer_layout` per_layer (fast decode) or stacked (shares a
  colocated trainer's buffers).
- `RolloutDriver`: prompts x n samples -> `RolloutBatch` (responses, response_mask,
  rollout_log_probs, ...), continuous batching with an on-device multi-step decode loop.
- `RolloutServer`: request-level, in-process serving over an engine (submit / generate /
  agenerate from many threads or coroutines; per-request sampling, budget and seed; session KV
  reuse across turns; abort; weight sync holding or finishing in-flight requests) returning
  `GenerateOutput` (tokens, log-probs, finish reason, policy version per token).
- `ReplicaRouter`: the server's API over several replicas (`Replica`; in process `LocalReplica`
  over a `RolloutServer`): sticky by session, least in-flight otherwise, a bound per replica,
  weight syncs and suspend/sleep to all, per-replica metrics, failover when a replica dies and
  (optionally) its restart. `ProcessReplica`: a replica in a child process (killable).
- `SamplingParams`, `sample`: greedy / temperature / top-k / top-p with log-probs.
- `rollout.jetstream_adapter` (imports jetstream lazily; the `jetstream` extra) and
  `python -m rollout.serve` (gRPC server) serve an engine through JetStream.

This package does not import optax or trainer code.
"""
from ._driver import RolloutBatch, RolloutDriver
from ._engine import BATCH_INVARIANT_ROWS, PREFILL_BUCKETS, Engine, default_compiler_options, prefill_bucket
from ._sampling import SamplingParams, sample
from ._replica import LocalReplica, Replica
from ._process_replica import ProcessReplica
from ._router import ReplicaRouter
from ._server import GenerateOutput, RolloutServer
from ._state import DecodeState, Prefix, ResultTokens, SlotData

__all__ = ["Engine", "RolloutDriver", "RolloutBatch", "RolloutServer", "GenerateOutput",
           "ReplicaRouter", "Replica", "LocalReplica", "ProcessReplica",
           "SamplingParams", "sample", "DecodeState", "Prefix", "ResultTokens", "SlotData",
           "BATCH_INVARIANT_ROWS", "PREFILL_BUCKETS", "prefill_bucket", "default_compiler_options"]
