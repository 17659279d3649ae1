"""resolve_resume and interrupted-save handling."""
import jax.numpy as jnp
import pytest

from jaxrl_llm.checkpoint import Checkpointer, finalized_steps, resolve_resume


def _save_steps(root, steps):
    with Checkpointer(root, async_save=False, max_to_keep=None) as ckpt:
        for step in steps:
            ckpt.save(step, {"x": jnp.full((2,), float(step))}, {"step": step})


def _fake_interrupted_save(root, step):
    """What a crash mid-save leaves: orbax's temporary directory, never renamed."""
    tmp = root / f"{step}.orbax-checkpoint-tmp-1712345678901234"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "partial.bin").write_bytes(b"\0" * 16)
    return tmp


def test_resume_auto_picks_latest_complete(tmp_path):
    _save_steps(tmp_path, [10, 30, 20])
    assert resolve_resume("auto", tmp_path) == (tmp_path.absolute(), 30)


def test_resume_auto_without_checkpoints_is_none(tmp_path):
    assert resolve_resume("auto", tmp_path / "nothing_here") is None
    (tmp_path / "empty").mkdir()
    assert resolve_resume("auto", tmp_path / "empty") is None


def test_resume_disable_is_none_even_with_checkpoints(tmp_path):
    _save_steps(tmp_path, [1])
    assert resolve_resume("disable", tmp_path) is None


def test_resume_explicit_step_dir_and_root(tmp_path):
    _save_steps(tmp_path / "ckpts", [10, 20])
    other = tmp_path / "unused"
    assert resolve_resume(str(tmp_path / "ckpts" / "10"), other) == (tmp_path / "ckpts", 10)
    assert resolve_resume(str(tmp_path / "ckpts"), other) == (tmp_path / "ckpts", 20)


def test_resume_missing_path_raises_naming_path(tmp_path):
    missing = tmp_path / "ckpts" / "99"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_resume(str(missing), tmp_path)
    (tmp_path / "empty_root").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        resolve_resume(str(tmp_path / "empty_root"), tmp_path)


def test_interrupted_save_is_never_latest(tmp_path):
    _save_steps(tmp_path, [10, 20])
    tmp = _fake_interrupted_save(tmp_path, 40)
    assert tmp.exists()
    assert finalized_steps(tmp_path) == [10, 20]
    assert resolve_resume("auto", tmp_path) == (tmp_path.absolute(), 20)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_step() == 20
    state, meta = ckpt.restore()
    assert meta == {"step": 20}
    assert float(state["x"][0]) == 20.0
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        resolve_resume(str(tmp), tmp_path)
