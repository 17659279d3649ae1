"""verl's validation metrics (`process_validation_metrics`) against hand-computed values."""
import numpy as np
import pytest

from jaxrl_llm.metrics import bootstrap_metric, process_validation_metrics
from jaxrl_llm.metrics._validation import majority_value

B = 20_000  # bootstrap draws: the estimates below sit within ~0.004 of the exact values
TOL = 0.015


def test_mean_and_std_at_n_are_exact_and_core():
    # prompt a: scores 1,0,0,1 ; prompt b: 1,1,1,1 -> mean@4 = (0.5 + 1) / 2, std@4 = (0.5 + 0) / 2
    m = process_validation_metrics(["gsm8k"] * 8, [0, 0, 0, 0, 1, 1, 1, 1],
                                   {"reward": [1, 0, 0, 1, 1, 1, 1, 1]}, n_bootstrap=200)
    assert m["val-core/gsm8k/reward/mean@4"] == pytest.approx(0.75)
    assert m["val-aux/gsm8k/reward/std@4"] == pytest.approx(0.25)


def test_best_and_worst_of_n_match_their_probabilities():
    # one prompt, half its responses right: best@k = 1 - 0.5^k, worst@k = 0.5^k
    m = process_validation_metrics(["s"] * 4, [0] * 4, {"reward": [1, 0, 1, 0]}, n_bootstrap=B)
    assert m["val-aux/s/reward/best@2/mean"] == pytest.approx(0.75, abs=TOL)
    assert m["val-aux/s/reward/best@2/std"] == pytest.approx(np.sqrt(0.75 * 0.25), abs=TOL)
    assert m["val-aux/s/reward/worst@2/mean"] == pytest.approx(0.25, abs=TOL)
    assert m["val-core/s/reward/best@4/mean"] == pytest.approx(1 - 0.5**4, abs=TOL)
    assert m["val-aux/s/reward/worst@4/mean"] == pytest.approx(0.5**4, abs=TOL)
    # as in verl: core = mean/maj/best at the largest n of the core variable; worst is aux
    assert {k for k in m if k.startswith("val-core/")} == {
        "val-core/s/reward/mean@4", "val-core/s/reward/best@4/mean", "val-core/s/reward/best@4/std"}


def test_majority_vote_uses_pred_and_is_not_a_variable():
    # values 1,1,0 with predictions 5,5,7; a subset of 3 votes 7 iff it holds >= 2 sevens:
    # P = 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27, so maj@3 = 20/27
    m = process_validation_metrics(["s"] * 3, [0] * 3, {"reward": [1, 1, 0], "pred": [5, 5, 7]},
                                   n_bootstrap=B)
    assert m["val-core/s/reward/maj@3/mean"] == pytest.approx(20 / 27, abs=TOL)
    assert m["val-aux/s/reward/maj@2/mean"] == pytest.approx(
        # two fives 4/9 -> 1; two sevens 1/9 -> 0; one of each 4/9: a tie, the first drawn wins -> 1/2
        4 / 9 + 4 / 9 * 0.5, abs=TOL)
    assert not any("/pred/" in k for k in m)


def test_majority_value_ties_go_to_the_first_prediction():
    assert majority_value([(1.0, 5), (0.0, 7), (0.0, 7)]) == 0.0
    assert majority_value([(1.0, 5), (0.0, 7)]) == 1.0
    assert majority_value([(0.0, 7), (1.0, 5)]) == 0.0


def test_other_fields_go_to_aux_and_acc_becomes_core():
    m = process_validation_metrics(["a", "a", "b", "b"], [0, 0, 1, 1],
                                   {"reward": [1, 0, 0, 0], "acc": [1, 1, 0, 1], "format": [1, 1, 1, 0]},
                                   n_bootstrap=50)
    assert m["val-core/a/acc/mean@2"] == 1.0 and m["val-core/b/acc/mean@2"] == 0.5
    assert m["val-aux/a/reward/mean@2"] == 0.5 and m["val-aux/b/format/mean@2"] == 0.5
    assert not any(k.startswith("val-core/") and "/reward/" in k for k in m)


def test_single_response_gives_only_mean():
    m = process_validation_metrics(["s", "s"], [0, 1], {"reward": [1, 0]})
    assert m == {"val-core/s/reward/mean@1": 0.5}


def test_bootstrap_is_seeded_and_constant_data_has_zero_std():
    a = bootstrap_metric([0, 1, 2, 3], 2, [max], n_bootstrap=100, seed=3)
    assert a == bootstrap_metric([0, 1, 2, 3], 2, [max], n_bootstrap=100, seed=3)
    assert bootstrap_metric([2.0] * 5, 3, [max, min], n_bootstrap=10) == [(2.0, 0.0), (2.0, 0.0)]
