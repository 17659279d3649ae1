"""What every role shares: building models from config, optimizers, and placing host batches.

Workers own state; this module owns the small pieces they build it from. Mesh axes stay in
`sharding/` (we ask it for shardings by logical names).
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sharding
from jaxrl_llm import models
from jaxrl_llm.config import ModelSection, OptimConfig

log = logging.getLogger(__name__)


def model_config_for(section: ModelSection, vocab_size: int) -> models.ModelConfig:
    """The architecture of a from-scratch model (`model.path == ""`).

    The vocabulary is padded to a multiple of 128 (as Qwen and MaxText do) so it shards over any
    tensor-parallel size; the padded rows are never produced by the tokenizer.
    """
    i = section.init
    return models.ModelConfig(
        vocab_size=-(-vocab_size // 128) * 128, hidden_size=i.hidden_size, intermediate_size=i.intermediate_size,
        num_hidden_layers=i.num_hidden_layers, num_attention_heads=i.num_attention_heads,
        num_key_value_heads=i.num_key_value_heads, head_dim=i.head_dim, model_type=i.model_type,
        rope_theta=i.rope_theta, max_position_embeddings=i.max_position_embeddings,
        tie_word_embeddings=i.tie_word_embeddings, attention_bias=i.model_type == "qwen2",
        qk_norm=i.model_type in ("qwen3", "qwen3_moe"), num_experts=i.num_experts,
        num_experts_per_tok=i.num_experts_per_tok, moe_intermediate_size=i.moe_intermediate_size,
        norm_topk_prob=i.norm_topk_prob, mlp_only_layers=tuple(i.mlp_only_layers),
        decoder_sparse_step=i.decoder_sparse_step, dtype=section.dtype, param_dtype=section.param_dtype,
        remat=section.remat, train_attention=section.train_attention,
        decode_attention=section.decode_attention)


def build_model(section: ModelSection, *, vocab_size: int, mesh, value_head: bool = False):
    """A CausalLM (or ValueModel) placed on `mesh` by the training rules."""
    if section.path:
        return models.from_pretrained(section.path, dtype=section.dtype, param_dtype=section.param_dtype,
                                      value_head=value_head, mesh=mesh, rules=sharding.TRAIN_RULES,
                                      remat=section.remat, train_attention=section.train_attention,
                                      decode_attention=section.decode_attention)
    cfg = model_config_for(section, vocab_size)
    seed = section.init.seed + (1 if value_head else 0)
    ctor = (models.ValueModel if value_head else models.CausalLM)
    return sharding.init_sharded(lambda: ctor(cfg, rngs=nnx.Rngs(params=seed)), mesh, sharding.TRAIN_RULES)


def lr_schedule(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    warm = max(optim.warmup_steps, 0)
    if optim.lr_schedule == "constant":
        if warm == 0:
            return optax.constant_schedule(optim.lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, optim.lr, warm), optax.constant_schedule(optim.lr)], [warm])
    return optax.warmup_cosine_decay_schedule(
        0.0, optim.lr, warmup_steps=warm, decay_steps=max(total_steps, warm + 1),
        end_value=optim.lr * optim.min_lr_ratio)


def decay_mask(params):
    """True for the parameters weight decay applies to: those with more than one dimension
    (matrices, embeddings); norm scales and biases (1-D) are left alone, as usual."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def build_optimizer(optim: OptimConfig, total_steps: int):
    """AdamW with global-norm clipping. Returns (transformation, schedule).

    Weight decay skips 1-D parameters unless `optim.weight_decay_1d` is set."""
    schedule = lr_schedule(optim, total_steps)
    parts = []
    if optim.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_grad))
    parts.append(optax.adamw(schedule, b1=optim.betas[0], b2=optim.betas[1], eps=optim.eps,
                             weight_decay=optim.weight_decay,
                             mask=None if optim.weight_decay_1d else decay_mask))
    return optax.chain(*parts), schedule


@dataclasses.dataclass
class TrainState:
    """Parameters and optimizer state of one trained role (a pytree)."""

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "opt_state", "step"], meta_fields=[])


def opt_state_shardings(tx, params, mesh):
    """Where the optimizer state of `params` (arrays or ShapeDtypeStructs with shardings) lives:
    a leaf that mirrors a parameter (Adam's moments) has that parameter's sharding, the others
    (step counts) are replicated on the mesh. (`jit(tx.init)` alone puts every leaf on one
    device: `zeros_like` does not carry the parameter's sharding.)"""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return optax.tree_utils.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                                            shardings_of(params), transform_non_params=lambda _: replicated)


def init_train_state(params, tx, mesh) -> TrainState:
    """Optimizer state built on device, sharded like the params (`opt_state_shardings`)."""
    opt_state = jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), replicated))


def shardings_of(tree):
    """The sharding of every array in a tree (to pin a jitted step's outputs to its inputs)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def batch_sharding(mesh, ndim: int, batch_axis: int = 0):
    """Rows sharded over the data-parallel axes, everything else replicated."""
    axes = [None] * ndim
    axes[batch_axis] = "batch"
    return sharding.logical_sharding(mesh, tuple(axes), sharding.TRAIN_RULES)


def data_parallel_size(mesh) -> int:
    return sharding.logical_axis_size(mesh, "batch", sharding.TRAIN_RULES)


def put_batch(mesh, arrays: dict[str, np.ndarray], batch_axis: int = 0) -> dict[str, jax.Array]:
    """Host numpy (the full batch, on every host) -> global arrays sharded by rows.

    Each host contributes its own contiguous block of rows (`sharding.process_batch_slice`), so
    only host-local data is placed on a host's devices.
    """
    out = {}
    for k, v in arrays.items():
        s = batch_sharding(mesh, v.ndim, batch_axis)
        if jax.process_count() == 1:
            out[k] = jax.device_put(v, s)
        else:
            rows = sharding.process_batch_slice(v.shape[batch_axis])
            local = np.take(v, np.arange(v.shape[batch_axis])[rows], axis=batch_axis)
            out[k] = jax.make_array_from_process_local_data(s, local, v.shape)
    return out
