"""Workers: the state owners of each model role (actor, reference, critic, SFT) and the
per-host `HostWorker` that the controller drives locally or through Ray."""
from ._common import TrainState, build_model, build_optimizer, lr_schedule, model_config_for
from ._host import HostWorker
from ._roles import ActorWorker, CriticWorker, ReferenceWorker, SFTWorker

__all__ = ["ActorWorker", "CriticWorker", "HostWorker", "ReferenceWorker", "SFTWorker", "TrainState",
           "build_model", "build_optimizer", "lr_schedule", "model_config_for"]
