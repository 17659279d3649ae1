"""jaxrl-llm: RL post-training for LLMs in JAX (verl's loop on Flax NNX, Optax and a JetStream-API
engine). Sub-packages: models, algos, data, rewards, workers, trainer, checkpoint, metrics, config.

Kept import-free on purpose: reward pool workers import this package and must start fast.
"""

__version__ = "0.1.0"
