"""Test set-up: 8 fake CPU devices so every mesh shape runs on a laptop or CI box.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports JAX.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
