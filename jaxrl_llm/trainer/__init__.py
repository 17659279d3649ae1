"""The controller: the RL loop (`RLTrainer`) and where its workers live (`local` / `ray`)."""
from ._backend import LocalGroup, RayGroup, WorkerError, make_group
from ._rl import NonFiniteError, RLTrainer, load_tokenizer, prepare_builtin_data

__all__ = ["LocalGroup", "NonFiniteError", "RLTrainer", "RayGroup", "WorkerError", "load_tokenizer",
           "make_group", "prepare_builtin_data"]
