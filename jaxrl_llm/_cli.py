"""What `python -m jaxrl_llm.train` and `python -m jaxrl_llm.sft` share at the command line.

A mistake the user can fix (a config file that is not there, a misspelt or ill-typed override,
a value outside its choices) ends the process with one line on stderr and exit status 2, not a
traceback. Running the job itself is left to the trainer.
"""
from __future__ import annotations

import os
import sys

from absl import flags

USAGE_ERROR = 2


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR)


def _text(e: BaseException) -> str:
    while len(e.args) == 1 and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(..))
        e = e.args[0]
    msg = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    lines = [part.strip() for part in msg.splitlines() if part.strip()]
    if any(line.startswith("Traceback") for line in lines):  # a config file raised: its last line
        return f"{lines[0].rstrip(':')}: {lines[-1]}"
    # ml_collections' KeyError text: "'x'\nDid you mean ..." -> "'x': Did you mean ..."
    return ": ".join(lines)


def last_override_wins(argv: list[str]) -> list[str]:
    """`argv` without the earlier copies of a repeated `--config.a.b=v`: the last one replaces
    them, for list-valued fields too (ml_collections would append the values of a tuple field)."""
    key = lambda a: a.split("=", 1)[0] if a.startswith("--config.") and "=" in a else None  # noqa: E731
    last = {key(a): i for i, a in enumerate(argv) if key(a)}
    return [a for i, a in enumerate(argv) if key(a) is None or last[key(a)] == i]


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (an `app.run` flags_parser) with an unknown config field, a value
    of the wrong type or an unknown flag reported as one line."""
    try:
        return flags.FLAGS(last_override_wins(argv))
    except flags.Error as e:
        fail(_text(e))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # ml_collections overrides
        bad = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
        fail(f"bad override {_text(e)} (overrides given: {', '.join(bad) or 'none'})")
    return []  # unreachable


def load_run(config_flag, flag_name: str = "config"):
    """The validated `RunConfig` of a `config_flags` flag; any config error is one line."""
    from ml_collections.config_flags import config_flags

    from jaxrl_llm.config import ConfigError, to_run_config

    value = config_flag.value
    if isinstance(value, config_flags._ErrorConfig):  # noqa: SLF001 - how ml_collections reports it
        path = config_flags.get_config_filename(flags.FLAGS[flag_name]).split(":")[0]
        where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
        if not os.path.exists(path):
            fail(f"--{flag_name}: config file {path!r} not found{where}")
        fail(f"--{flag_name}: could not load {path!r}: {_text(object.__getattribute__(value, '_error'))}")
    try:
        return to_run_config(value)
    except ConfigError as e:
        fail(_text(e))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a config file's own check
        fail(f"--{flag_name}: {_text(e)}")
    return None  # unreachable


CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache, so a rerun (or a second run of the same
    config) loads its compiled programs instead of compiling them again: `$JAX_COMPILATION_CACHE_DIR`
    when set (set it empty to turn the cache off), else `$XDG_CACHE_HOME/jaxrl_llm/jax`
    (`~/.cache/jaxrl_llm/jax`). Programs of any compile time are cached (small CPU programs too).
    The variables are set in this process's environment, which the Ray workers inherit
    (trainer `forward_env`). Returns the folder, or None when off."""
    if CACHE_ENV in os.environ:
        path = os.environ[CACHE_ENV] or None
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.environ[CACHE_ENV] = os.path.join(base, "jaxrl_llm", "jax")
    if path is None:
        return None
    os.environ.setdefault(MIN_TIME_ENV, "0")
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ[MIN_TIME_ENV]))
    return path


def completed_step(run) -> int | None:
    """The newest checkpoint's step when it already reaches `trainer.total_training_steps` (and
    `trainer.resume_mode` is auto) and the run's exports are written: the run is complete. Else
    None. Checkpoints that are all
    damaged end the process with one line (`NoUsableCheckpoint`'s message)."""
    from jaxrl_llm.checkpoint import NoUsableCheckpoint, checkpoint_root, resolve_resume

    if run.trainer.resume_mode != "auto" or run.trainer.val_only:
        return None
    try:
        resume = resolve_resume("auto", checkpoint_root(run.trainer.default_local_dir))
    except NoUsableCheckpoint as e:  # every step damaged: one line, before anything is touched
        fail(str(e))
    if resume is not None and resume[1] >= run.trainer.total_training_steps and _exported(run):
        return resume[1]
    return None


def _exported(run) -> bool:
    """Whether the exports a finished run writes are there: a run killed after its last
    checkpoint but before them resumes at that step and only exports."""
    import glob

    t = run.trainer
    folders = ([f"{t.default_local_dir}/hf_actor"] if t.export_hf else []) + (
        [f"{t.default_local_dir}/lora_adapter"] if t.export_hf and run.actor.lora.enabled else [])
    return all(glob.glob(f"{folder}/*.safetensors") for folder in folders)
