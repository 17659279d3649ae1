"""Flax NNX decoder models (Llama 3, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral), Hugging Face I/O and
tokenizers."""
from . import _jax_cache
from ._config import ModelConfig, RopeScaling, to_dtype
from ._decoder import (LAYER_LAYOUTS, CausalLM, KVCache, Transformer, ValueModel, abstract_model,
                       attend, causal_padding_mask, count_params, default_positions, init_model,
                       rope_inv_freq, segment_positions, stack_layers, unstack_layers, convert_layers,
                       params_layout, load_balancing_loss, router_z_loss, expert_load, route, replay_route,
                       expert_index_dtype, routing_mismatch, ragged_dot_expanded,
                       warn_if_experts_expanded, KV_CACHE_DTYPES, kv_cache_dtype, to_cache)
from ._lora import (LORA_TARGETS, LoraSpec, add_lora, merge_lora, merged_model, resolve_targets,
                    split_lora)
from ._peft import load_peft_adapter, read_peft_config, save_peft_adapter
from ._hf import config_from_hf, config_to_hf, from_pretrained, save_pretrained
from ._tokenizer import (CharTokenizer, HFTokenizer, compile_chat_template, load_tokenizer)
from ._presets import QWEN25_SHAPES, QWEN3_MOE_SHAPES

_jax_cache.install()  # atomic writes to JAX's persistent compilation cache (module docstring)
