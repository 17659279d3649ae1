"""resolve_resume, interrupted-save handling, verification of a step's files and rollback."""
import logging

import jax.numpy as jnp
import pytest

from jaxrl_llm.checkpoint import (COMPLETE_MARKER, Checkpointer, NoUsableCheckpoint, finalized_steps,
                                  resolve_resume, set_aside_steps, verify_step)
from jaxrl_llm.checkpoint._resume import SET_ASIDE_DIR


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


def _largest_file(step_dir):
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER),
               key=lambda p: p.stat().st_size)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip])
def test_resume_auto_skips_a_damaged_newest_step_and_says_why(tmp_path, caplog, damage):
    _save_steps(tmp_path, [10, 20])
    damage(_largest_file(tmp_path / "20"))
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == (tmp_path.absolute(), 10)
    assert "skipping checkpoint step 20" in caplog.text
    assert ("bytes" in caplog.text) if damage is _truncate else ("CRC-32" in caplog.text)
    state, meta = Checkpointer(tmp_path).restore(10)
    assert meta == {"step": 10} and float(state["x"][0]) == 10.0
    with pytest.raises(FileNotFoundError, match="not a usable checkpoint step"):
        resolve_resume(str(tmp_path / "20"), tmp_path)


def test_resume_auto_never_picks_an_empty_or_unmarked_step_dir(tmp_path, caplog):
    _save_steps(tmp_path, [10, 20])
    (tmp_path / "30").mkdir()  # a crash's empty leftover
    (tmp_path / "20" / COMPLETE_MARKER).unlink()  # finalised by orbax, marker never written
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", tmp_path) == (tmp_path.absolute(), 10)
    assert "skipping checkpoint step 30" in caplog.text and "skipping checkpoint step 20" in caplog.text
    assert finalized_steps(tmp_path) == [10]


def test_set_aside_moves_newer_and_broken_steps_so_saving_works_again(tmp_path):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2, 3])
    (root / "5").mkdir()
    _fake_interrupted_save(root, 4)
    moved = set_aside_steps(root, keep_up_to=1)
    assert sorted(p.name for p in moved)[:3] == ["2", "3", "4.orbax-checkpoint-tmp-1712345678901234"]
    assert sorted(p.name for p in root.iterdir()) == ["1"]
    assert all(p.exists() and SET_ASIDE_DIR in str(p) for p in moved)  # moved, not deleted
    with Checkpointer(root, async_save=False, max_to_keep=None) as ckpt:  # saves 2 again
        assert ckpt.save(2, {"x": jnp.zeros((2,))}, {"step": 2})
    assert resolve_resume("auto", root) == (root.absolute(), 2)


def test_async_save_is_marked_complete_only_after_it_finished(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=True, max_to_keep=None)
    ckpt.save(1, {"x": jnp.ones((2,))}, {"step": 1})
    ckpt.wait()
    assert verify_step(tmp_path / "1") is None
    ckpt.close()


def test_restoring_a_damaged_meta_file_names_the_step(tmp_path):
    _save_steps(tmp_path, [10])
    meta = next(p for p in (tmp_path / "10" / "meta").rglob("*") if p.is_file())
    meta.write_text(meta.read_text()[:5])
    with pytest.raises(ValueError, match=rf"cannot read step {tmp_path.absolute()}/10 .*older step"):
        Checkpointer(tmp_path).restore(10)


def test_a_checkpointer_opened_before_steps_were_set_aside_still_saves(tmp_path):
    """Multi-host: another process's controller moves steps aside after this one listed them."""
    _save_steps(tmp_path, [1, 2, 3])
    ckpt = Checkpointer(tmp_path, async_save=False, max_to_keep=None)
    assert ckpt.all_steps() == [1, 2, 3]
    set_aside_steps(tmp_path, keep_up_to=1)
    assert ckpt.save(2, {"x": jnp.zeros((2,))}, {"step": 2})
    ckpt.close()
    assert resolve_resume("auto", tmp_path) == (tmp_path.absolute(), 2)


def test_no_usable_step_among_several_is_an_error_naming_the_folder_and_each_fault(tmp_path):
    _save_steps(tmp_path, [10, 20])
    _truncate(_largest_file(tmp_path / "20"))
    _flip(_largest_file(tmp_path / "10"))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(NoUsableCheckpoint) as err:
        resolve_resume("auto", tmp_path)
    text = str(err.value)
    assert str(tmp_path.absolute()) in text and "\n" not in text
    assert "step 20: file" in text and "truncated" in text
    assert "step 10: file" in text and "CRC-32" in text
    assert "trainer.resume_mode=disable" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing moved or deleted
    with pytest.raises(NoUsableCheckpoint, match=str(tmp_path.absolute())):
        resolve_resume(str(tmp_path), tmp_path / "unused")  # an explicit root: the same check
    assert resolve_resume("disable", tmp_path) is None  # the one way to start over


def test_one_damaged_step_alone_is_an_error_but_one_interrupted_first_save_starts_fresh(tmp_path):
    _save_steps(tmp_path / "a", [1])
    _truncate(_largest_file(tmp_path / "a" / "1"))
    with pytest.raises(NoUsableCheckpoint, match="step 1: file"):
        resolve_resume("auto", tmp_path / "a")
    # a kill between orbax's finalisation and the marker of the first save: nothing was lost
    _save_steps(tmp_path / "b", [1])
    (tmp_path / "b" / "1" / COMPLETE_MARKER).unlink()
    assert resolve_resume("auto", tmp_path / "b") is None
    # two of them are not what one kill leaves: an error
    _save_steps(tmp_path / "b", [2])
    (tmp_path / "b" / "2" / COMPLETE_MARKER).unlink()
    with pytest.raises(NoUsableCheckpoint, match="step 2: incomplete.*step 1: incomplete"):
        resolve_resume("auto", tmp_path / "b")
