"""Rollout correction (IS weights, rejection, veto, mismatch metrics) and DAPO helpers."""
import numpy as np
import pytest

from jaxrl_llm import algos


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# row 0: token ratios [3, 0.25, (pad)]; row 1: ratios [1, 1, 1]
OLD = np.log(np.float32([[3.0, 0.25, 7.0], [1.0, 1.0, 1.0]]))
ROLL = np.zeros_like(OLD)
MASK = np.float32([[1, 1, 0], [1, 1, 1]])


def test_token_is_weights_are_truncated_and_zero_on_padding():
    w, m = algos.rollout_is_weights(OLD, ROLL, MASK, rollout_is="token", rollout_is_threshold=2.0)
    close(w, [[2.0, 0.25, 0.0], [1.0, 1.0, 1.0]])
    close(m["rollout_is_max"], 3.0)  # metrics are taken before truncation
    close(m["rollout_is_ratio_fraction_high"], 1 / 5)
    close(m["rollout_is_ratio_fraction_low"], 1 / 5)
    # ESS on weights clamped to [0.5, 2]: [2, .5, 1, 1, 1], mean 1.1
    wc = np.array([2.0, 0.5, 1, 1, 1])
    close(m["rollout_is_eff_sample_size"], 1 / np.mean((wc / 1.1) ** 2))


def test_sequence_is_weights_use_product_of_ratios():
    w, _ = algos.rollout_is_weights(OLD, ROLL, MASK, rollout_is="sequence",
                                    rollout_is_threshold=2.0)
    close(w, [[0.75, 0.75, 0.0], [1.0, 1.0, 1.0]])


def test_is_batch_normalize_gives_mean_one():
    w, m = algos.rollout_is_weights(OLD, ROLL, MASK, rollout_is="token", rollout_is_threshold=2.0,
                                    rollout_is_batch_normalize=True)
    close((np.asarray(w) * MASK).sum() / MASK.sum(), 1.0)
    close(m["rollout_is_batch_norm_factor"], 5.25 / 5)


@pytest.mark.parametrize("level, expected", [
    ("token", [[0, 0, 0], [1, 1, 1]]),        # 3 > 2 and 0.25 < 0.5 rejected
    ("sequence", [[1, 1, 0], [1, 1, 1]]),     # product 0.75 is inside [0.5, 2]
    ("geometric", [[1, 1, 0], [1, 1, 1]]),    # sqrt(0.75) inside
])
def test_rejection_mask_levels(level, expected):
    new_mask, m = algos.rollout_rejection_mask(OLD, ROLL, MASK, rollout_rs=level,
                                               rollout_rs_threshold=2.0)
    close(new_mask, expected)
    assert "rollout_rs_masked_fraction" in m


def test_rejection_with_explicit_lower_threshold():
    new_mask, m = algos.rollout_rejection_mask(OLD, ROLL, MASK, rollout_rs="sequence",
                                               rollout_rs_threshold=2.0,
                                               rollout_rs_threshold_lower=0.8)
    close(new_mask, [[0, 0, 0], [1, 1, 1]])
    close(m["rollout_rs_seq_masked_fraction"], 0.5)


def test_rollout_correction_veto_and_mismatch_metrics():
    w, new_mask, m = algos.rollout_correction(OLD, ROLL, MASK, rollout_is="token",
                                              rollout_token_veto_threshold=0.3)
    close(new_mask, [[0, 0, 0], [1, 1, 1]])  # 0.25 < 0.3 vetoes row 0
    close(m["rollout_corr/rollout_is_veto_fraction"], 0.5)
    close(m["rollout_corr/kl"], -(np.log(3.0) + np.log(0.25)) / 5)
    close(m["rollout_corr/k3_kl"], ((3 - np.log(3) - 1) + (0.25 - np.log(0.25) - 1)) / 5)
    close(m["rollout_corr/chi2_token"], (9 + 1 / 16 + 3) / 5 - 1)
    close(m["rollout_corr/chi2_seq"], (0.75 ** 2 + 1) / 2 - 1)
    assert w is not None
    none_w, same_mask, _ = algos.rollout_correction(OLD, ROLL, MASK)
    assert none_w is None
    close(same_mask, MASK)


def test_rollout_levels_are_validated():
    with pytest.raises(ValueError, match="geometric"):
        algos.rollout_rejection_mask(OLD, ROLL, MASK, rollout_rs="tok", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="positive"):
        algos.rollout_is_weights(OLD, ROLL, MASK, rollout_is_threshold=-1.0)


def test_overlong_penalty_hand_values():
    pen = algos.overlong_penalty(np.array([10, 16, 17, 20]), max_response_length=20,
                                 overlong_buffer_len=4, overlong_penalty_factor=1.0)
    close(pen, [0.0, 0.0, -0.25, -1.0])


def test_sequence_scores_land_on_last_response_token():
    mask = np.float32([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = algos.sequence_scores_to_token_level(np.float32([2.0, 3.0, 4.0]), mask)
    close(out, [[0, 2, 0], [0, 0, 0], [0, 0, 4]])


def test_dynamic_sampling_keeps_varied_groups_and_singletons():
    metric = np.float32([1, 1, 0, 1, 0.1, 0.1, 0.1, 3])
    ids = np.int32([5, 5, 9, 9, 1000, 1000, 1000, 77])
    keep = algos.dynamic_sampling_keep_mask(metric, ids)
    assert np.asarray(keep).tolist() == [False, False, True, True, False, False, False, True]
