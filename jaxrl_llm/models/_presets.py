"""Architecture shapes of public checkpoints, for benchmarks and `jax.eval_shape` studies of
real-size models without their weights (values from each model's Hugging Face config.json)."""
from __future__ import annotations

QWEN25_SHAPES: dict[str, dict] = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    # a CPU-sized stand-in with the same structure, for --tiny benchmark runs
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}

# Qwen3-MoE (model_type qwen3_moe: qk_norm, no attention bias, every layer sparse)
QWEN3_MOE_SHAPES: dict[str, dict] = {
    "30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                    norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
                    max_position_embeddings=40960, rms_norm_eps=1e-6),
}
