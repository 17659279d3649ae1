"""What tests/trainer/test_trainer_process_replicas.py runs in a rollout replica's child process
(`ProcessReplica.run_in_child`): a module of its own, imported in the child by name through the
sys.path it inherits, so the child imports neither pytest nor the conftest files."""
import os
import signal


def arm_kill(server, after: int) -> None:
    """The child SIGKILLs itself at the end of the first decode loop once its server has admitted
    `after` requests: those requests are in flight (admitted, their tokens of that loop not yet
    sent back), whatever the timing of the parent's threads."""
    admitted = [0]
    submit, decode_loop = server.submit, server.engine.decode_loop

    def counting_submit(*args, **kwargs):
        future = submit(*args, **kwargs)
        admitted[0] += 1
        return future

    def killing_decode_loop(*args):
        out = decode_loop(*args)
        if admitted[0] >= after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    server.submit = counting_submit
    server.engine.decode_loop = killing_decode_loop
