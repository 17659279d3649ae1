"""`data.Batch`: verl's fields checked when set (kind, rank, dims that agree), host numpy only,
misspelt or missing fields named; rows selected / concatenated; it pickles (crosses Ray) and is
a pytree."""
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.data import Batch, MissingFieldError

B, P, T = 4, 3, 5


def _batch() -> Batch:
    ids = np.arange(B * (P + T), dtype=np.int32).reshape(B, P + T)
    return Batch(prompts=ids[:, :P], responses=ids[:, P:], input_ids=ids,
                 response_mask=np.ones((B, T), np.int32), group_ids=np.repeat(np.arange(2, dtype=np.int32), 2))


def test_a_missing_field_is_named_with_what_the_batch_holds():
    batch = _batch()
    with pytest.raises(MissingFieldError, match=r"Batch.values was never set \(critic values\); the batch "
                                                 r"holds prompts, responses, input_ids"):
        batch.values
    with pytest.raises(KeyError, match="Batch.old_log_probs was never set"):  # by name too
        batch["old_log_probs"]
    assert "values" not in batch and "responses" in batch


def test_a_misspelt_field_is_an_error_naming_the_close_one():
    batch = _batch()
    with pytest.raises(AttributeError):  # no silent new attribute
        batch.old_log_prob = np.zeros((B, T), np.float32)
    with pytest.raises(AttributeError, match="no field 'old_log_prob' \\(did you mean 'old_log_probs'\\?\\)"):
        batch.update({"old_log_prob": np.zeros((B, T), np.float32)})
    with pytest.raises(KeyError, match="did you mean 'values'"):
        batch["valuse"]
    with pytest.raises(AttributeError, match="no field 'entropys'"):
        Batch(entropys=np.zeros((B, T), np.float32))


def test_a_mis_shaped_field_names_the_axis_and_the_field_that_fixes_it():
    batch = _batch()
    with pytest.raises(ValueError, match=r"Batch.old_log_probs has shape \(4, 6\) but its 't' axis must be 5 "
                                         r"\('responses' has 5\)"):
        batch.old_log_probs = np.zeros((B, T + 1), np.float32)
    with pytest.raises(ValueError, match=r"Batch.advantages has shape \(3, 5\) but its 'B' axis must be 4"):
        batch.advantages = np.zeros((B - 1, T), np.float32)
    with pytest.raises(ValueError, match=r"Batch.values must have shape \[B, t\] \(critic values\), got shape \(4,\)"):
        batch.values = np.zeros((B,), np.float32)
    with pytest.raises(ValueError, match=r"Batch.attention_mask has shape \(4, 7\) but its 's' axis must be 8 "
                                         r"\('input_ids' has 8\)"):
        batch.attention_mask = np.ones((B, P + T - 1), np.int32)
    parts = Batch(prompts=batch.prompts, responses=batch.responses)
    with pytest.raises(ValueError, match=r"sequence fields are 7 tokens wide but prompts \+ responses are 3 \+ 5"):
        parts.attention_mask = np.ones((B, P + T - 1), np.int32)


def test_wrong_kinds_and_device_arrays_are_refused():
    batch = _batch()
    with pytest.raises(TypeError, match="Batch.old_log_probs must hold floats .* got dtype int32"):
        batch.old_log_probs = np.zeros((B, T), np.int32)
    with pytest.raises(TypeError, match="Batch.values is a jax.Array; a Batch holds host numpy only"):
        batch.values = jnp.zeros((B, T))
    with pytest.raises(TypeError, match="must be a numpy array, got list"):
        batch.group_ids = [0, 0, 1, 1]


def test_rows_select_concat_pickle_and_pytree():
    batch = _batch()
    batch.old_log_probs = np.full((B, T), -1.0, np.float32)
    half = batch.select(np.array([True, False, True, False]))
    assert half.rows == 2 and half.sizes() == {"B": 2, "p": P, "t": T, "s": P + T}
    np.testing.assert_array_equal(half.input_ids, batch.input_ids[[0, 2]])
    both = Batch.concat([half, batch.select([1, 3])])
    np.testing.assert_array_equal(both.responses, batch.responses[[0, 2, 1, 3]])
    with pytest.raises(ValueError, match="fields differ"):
        Batch.concat([batch, Batch(prompts=batch.prompts)])
    back = pickle.loads(pickle.dumps(batch))
    assert list(back) == list(batch) and (back.old_log_probs == -1).all()
    doubled = jax.tree.map(lambda x: x * 2, batch)
    assert isinstance(doubled, Batch) and list(doubled) == list(batch)
    np.testing.assert_array_equal(doubled.old_log_probs, -2.0)
