"""Reading verl-style config files (YAML or JSON) and importing "module.attr" paths; shared by
the tool and interaction registries."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Any


def read_config_file(path: str | os.PathLike) -> Any:
    """The parsed content of a .json, .yaml or .yml file. YAML needs PyYAML."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if ext == ".json":
        return json.loads(text)
    if ext in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ImportError(f"reading {path} needs PyYAML: `pip install pyyaml`, or write "
                              f"the config as .json") from None
        return yaml.safe_load(text)
    raise ValueError(f"config file {path}: expected a .json, .yaml or .yml file")


def import_object(dotted: str, what: str) -> Any:
    """"package.module.Name" -> the object; ImportError naming `what` and the path."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{what} {dotted!r} is not a built-in name nor a 'module.Name' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{what} {dotted!r}: cannot import module {module_name!r} ({e}); "
                          f"is it on PYTHONPATH?") from e
    if not hasattr(module, attr):
        raise ImportError(f"{what} {dotted!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def import_file(path: str | os.PathLike, prefix: str) -> ModuleType:
    """Imports the Python file `path` as a module named after its absolute path."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Python file not found: {path}")
    name = f"{prefix}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def resolve_class(name: str, builtins: dict, base: type, what: str, base_path: str) -> type:
    """A built-in class by name, or a `base` subclass by "module.Class" path (tools and
    interactions name their classes the same way)."""
    if name in builtins:
        return builtins[name]
    if "." not in name:
        raise ValueError(f"unknown {what} {name!r}; built-ins: {sorted(builtins)}, or give "
                         f"a 'module.Class' path")
    cls = import_object(name, f"{what} class_name")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{what} class_name {name!r} is not a subclass of {base_path}")
    return cls


def config_entries(data: Any, key: str, path: str | os.PathLike) -> list[dict]:
    """`data[key]` as a list of mappings, or ValueError saying what the file should hold."""
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise ValueError(f"{os.fspath(path)}: expected a mapping with a list under {key!r} "
                         f"(verl's format), got {type(data).__name__}")
    for i, entry in enumerate(data[key]):
        if not isinstance(entry, dict):
            raise ValueError(f"{os.fspath(path)}: {key}[{i}] must be a mapping, "
                             f"got {type(entry).__name__}")
    return data[key]
