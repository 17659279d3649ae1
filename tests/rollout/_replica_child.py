"""What tests/rollout/test_process_replica.py runs inside a `ProcessReplica`'s child process: the
server factory and two calls for `run_in_child`. A module of its own (imported in the child by
name, through the sys.path the child inherits from pytest) so the child imports neither pytest
nor the conftest files."""
import threading

import rollout
from jaxrl_llm.models import init_model

_hold = {"at": None, "loops": 0}  # the child's decode-loop count and when to hold (run_in_child)
_held = threading.Event()


def tiny_server(config, stop_id):
    """A RolloutServer as tests/rollout/conftest.py's tiny_engine (same model seed and engine
    shape, per-layer layout, CPU device 0 of the child) whose engine suspends the server after
    the decode loop `arm_hold` names."""
    engine = rollout.Engine.from_model(init_model(config, seed=3), max_concurrent_decodes=4,
                                       max_prefill_length=16, max_target_length=32, temperature=0.0,
                                       stop_token_ids=(stop_id,), pad_token_id=0, layer_layout="per_layer")
    server = rollout.RolloutServer(engine, steps_per_sync=4)
    real = engine.decode_loop

    def decode_loop(*args):
        out = real(*args)
        _hold["loops"] += 1
        if _hold["loops"] == _hold["at"]:  # on the scheduler thread: the suspend applies next
            server.submit_suspend().add_done_callback(lambda _: _held.set())
        return out

    engine.decode_loop = decode_loop
    return server


def not_a_server():
    return 42


def never_ready():
    """A factory that never returns (stuck, as on a device another process holds)."""
    threading.Event().wait()


def arm_hold(server):
    """The server suspends itself after its next decode loop; returns the loops so far."""
    _hold["at"] = _hold["loops"] + 1
    return _hold["loops"]


def wait_held(server):
    """Waits until that suspend holds; returns the decode loops run and the requests running."""
    _held.wait()
    return _hold["loops"], len(server._running)
