"""What `python -m jaxrl_llm.train` and `python -m jaxrl_llm.sft` share at the command line.

A mistake the user can fix (a config file that is not there, a misspelt or ill-typed override,
a value outside its choices) ends the process with one line on stderr and exit status 2, not a
traceback. A machine without a TPU does not start libtpu (`skip_absent_tpu`). Running the job
itself is left to the trainer.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
import sys

from absl import flags

USAGE_ERROR = 2
CONFIGS_DOC = "docs/configs.md"
CONFIG_HELP = ("Run config file, path.py[:variant] (the shipped ones are in configs/); override any "
               f"field with --config.a.b=value. Every field, its default and meaning: {CONFIGS_DOC}.")
PLATFORMS_ENV = "JAX_PLATFORMS"
# set beside JAX_PLATFORMS when skip_absent_tpu chose it (not the user): the Ray backend then does
# not forward it to other nodes, which decide for themselves (one of them may hold a TPU)
PLATFORMS_AUTO_ENV = "JAXRL_LLM_AUTO_JAX_PLATFORMS"
_GPU_DEVICES = {"cuda": ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"), "rocm": ("/dev/kfd",)}
_PCI_GOOGLE = "0x1ae0"


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_ERROR)


def tpu_present() -> bool:
    """Whether this machine may hold a TPU: a `/dev/accel*` or `/dev/vfio/<n>` device (how TPU VMs
    expose their chips) or a Google PCI device that is neither storage nor network (JAX's own
    check looks at the PCI vendor too). Errs towards True."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _PCI_GOOGLE:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "class")) as f:
                pci_class = f.read().strip()
        except OSError:
            return True
        if not pci_class.startswith(("0x01", "0x02")):  # gVNIC and Google NVMe are not TPUs
            return True
    return False


def _jax_plugins() -> list[str]:
    """Names of the installed JAX PJRT plugins (`jax_plugins` entry points and namespace
    modules, e.g. xla_cuda12), found without importing them."""
    from importlib.metadata import entry_points

    names = [e.name for e in entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names += [m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))]
    return names


def platforms_without_tpu() -> str | None:
    """The JAX_PLATFORMS value that leaves out the TPU on a machine that has none ("cpu", or
    "cuda,cpu" where an NVIDIA GPU and JAX's CUDA plugin are both present), or None to leave JAX
    to choose: JAX_PLATFORMS (or JAX_FORCE_TPU_INIT) set by the user, libtpu not installed (no
    TPU to start), a TPU device present, or a JAX plugin for hardware this rule does not know."""
    if PLATFORMS_ENV in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return None
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        return None
    if tpu_present():
        return None
    platforms = []
    for name in _jax_plugins():
        kind = next((k for k in _GPU_DEVICES if k in name), None)
        if kind is None:
            if "tpu" in name:
                continue
            return None  # some other accelerator's plugin: JAX's own choice stays
        if kind not in platforms and any(os.path.exists(d) for d in _GPU_DEVICES[kind]):
            platforms.append(kind)
    return ",".join(platforms + ["cpu"])


def skip_absent_tpu() -> str | None:
    """Keeps JAX from starting libtpu where there is no TPU: with libtpu installed (the test
    extras) JAX otherwise tries it in every process and libtpu prints errors that look fatal
    (and takes /tmp/libtpu_lockfile). Sets JAX_PLATFORMS to `platforms_without_tpu()` when that is
    not None, in this process's environment (child processes inherit it) and in JAX's config if
    JAX is already imported (its backends must not have started yet). Called first by the
    command-line entry points and, as Ray's `worker_process_setup_hook`, in every Ray worker.
    Returns the value set, or None."""
    value = platforms_without_tpu()
    if value is None:
        return None
    os.environ[PLATFORMS_ENV] = os.environ[PLATFORMS_AUTO_ENV] = value
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", value)
    return value


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
    of the wrong type or an unknown flag reported as one line. The first thing both commands
    run, so it also calls `skip_absent_tpu` (before a config file can import JAX) and gives the
    --config flag the help text that points to docs/configs.md."""
    skip_absent_tpu()
    if "config" in flags.FLAGS:  # --help of both commands says where the fields are documented
        flags.FLAGS["config"].help = CONFIG_HELP
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
        run = to_run_config(value)
    except ConfigError as e:
        fail(_text(e))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a config file's own check
        fail(f"--{flag_name}: {_text(e)}")
    check_files(run)
    return run


def _config_files(run) -> list[tuple[str, str, str]]:
    """(field, path, what it must be) of every file or folder the config names, data aside."""
    mt, tok = run.rollout.multi_turn, run.model.tokenizer
    files = [("model.path", run.model.path, "model folder"),
             ("model.tokenizer", "" if tok == "char" else tok, "tokenizer folder"),
             ("reward.model.path", run.reward.model.path, "reward model folder"),
             ("reward.custom_reward_function.path", run.reward.custom_reward_function.path, "file"),
             ("rollout.multi_turn.tool_config_path", mt.tool_config_path, "file"),
             ("rollout.multi_turn.function_tool_path", mt.function_tool_path, "file"),
             ("rollout.multi_turn.interaction_config_path", mt.interaction_config_path, "file")]
    if run.trainer.backend == "ray" and os.environ.get("RAY_ADDRESS"):
        files = []  # the workers open these on the cluster's nodes, which this one may not see
    if run.trainer.resume_mode not in ("auto", "disable"):
        files.append(("trainer.resume_mode", run.trainer.resume_mode, "checkpoint (a path, or auto / disable)"))
    return [(field, path, what) for field, path, what in files if path and "://" not in path]


def check_files(run) -> None:
    """A file or folder the config names that is not there is one line naming the field (the
    data files are the data loader's to check), before anything starts."""
    for field, path, what in _config_files(run):
        if not os.path.exists(path):
            where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
            fail(f"{field}={path!r}: {what} not found{where}")


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
