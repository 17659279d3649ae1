"""Running code we do not trust (model-written snippets, user tools and reward functions).

`make_sandbox(kind)` picks a backend ("auto" | "bwrap" | "process"); `Sandbox.wrap` turns a
command into the one to exec (and its environment) so that it runs contained with `Limits`.
`clean_env` is the scrubbed environment every worker process starts with.
"""
from jaxrl_llm.sandbox._sandbox import (Limits, Sandbox, SandboxError, SANDBOX_KINDS, clean_env,
                                        make_sandbox)

__all__ = ["Limits", "Sandbox", "SandboxError", "SANDBOX_KINDS", "clean_env", "make_sandbox"]
