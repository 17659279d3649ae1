"""Built-in scorers on right, wrong and malformed answers (hand-written golden cases)."""
import json

import pytest

from jaxrl_llm.rewards import (
    arithmetic_score,
    countdown_score,
    default_compute_score,
    get_scorer,
    gsm8k_score,
    last_boxed_only_string,
    math_score,
    normalize_math_answer,
)


@pytest.mark.parametrize("response, truth, expected", [
    ("2 + 3 = 5 apples.\n#### 5", "5", 1.0),
    ("total is 1,200 dollars\n#### 1,200", "1200", 1.0),
    ("#### -3", "-3", 1.0),
    ("first #### 4 then corrected #### 5", "5", 1.0),  # the last one counts
    ("#### 6", "5", 0.0),  # wrong
    ("The answer is 5", "5", 0.0),  # no "#### " marker
    ("####5", "5", 0.0),  # strict: needs the space
    ("#### 5.0", "5", 0.0),  # exact string match, as verl
    ("#### 5" + "x" * 400, "5", 0.0),  # only the last 300 characters are searched
])
def test_gsm8k_strict_extraction(response, truth, expected):
    assert gsm8k_score(response, truth) == expected


@pytest.mark.parametrize("response, truth, expected", [
    (r"so the answer is $\boxed{\frac{1}{2}}$", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{\left( 3, 4 \right)}", "(3,4)", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{3/4}", r"\frac{3}{4}", 1.0),
    (r"\boxed 7$ done", "7", 1.0),
    (r"\fbox{8}", "8", 1.0),
    (r"\boxed{1} no wait \boxed{2}", "2", 1.0),
    (r"\boxed{1} no wait \boxed{2}", "1", 0.0),  # only the last box counts
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{3", "3", 0.0),  # unbalanced brace
    ("the answer is 3", "3", 0.0),  # no box
])
def test_math_boxed_with_normalisation(response, truth, expected):
    assert math_score(response, truth) == expected


def test_math_helpers():
    assert last_boxed_only_string(r"a \boxed{b{c}} d") == r"\boxed{b{c}}"
    assert last_boxed_only_string("nothing") is None
    assert normalize_math_answer(r"\tfrac{1}{4}") == r"\frac{1}{4}"
    assert normalize_math_answer("k = 1 2") == "12"


TRUTH = {"target": 9, "numbers": [3, 2, 1]}


@pytest.mark.parametrize("response, truth, expected", [
    ("<think>hmm</think><answer>(1 + 2) * 3</answer>", TRUTH, 1.0),
    ("<answer>(1+2)*3</answer>", json.dumps(TRUTH), 1.0),  # JSON-string ground truth
    ("<answer>1</answer> no: <answer>3 * (2 + 1)</answer>", TRUTH, 1.0),
    ("<answer>3 * 3</answer>", TRUTH, 0.1),  # numbers not used exactly once
    ("<answer>3 + 2 + 1</answer>", TRUTH, 0.1),  # valid but wrong value
    ("<answer>(1 + 2 * 3</answer>", TRUTH, 0.1),  # syntax error
    ("<answer>__import__('os')</answer>", TRUTH, 0.1),  # not arithmetic: never evaluated
    ("<answer>3 ** 2 + 0</answer>", TRUTH, 0.1),  # power is not allowed
    ("<answer>3 / (2 - 2)</answer>", {"target": 1, "numbers": [3, 2, 2]}, 0.1),
    ("(1 + 2) * 3", TRUTH, 0.0),  # no answer tags
])
def test_countdown(response, truth, expected):
    assert countdown_score(response, truth) == pytest.approx(expected)


@pytest.mark.parametrize("response, expected", [
    ("95", 1.0), (" 95\n", 1.0), ("+95", 1.0),
    ("96", 0.0), ("9 5", 0.0), ("95.0", 0.0), ("95abc", 0.0), ("", 0.0), ("=95", 0.0),
])
def test_arithmetic_exact_integer(response, expected):
    assert arithmetic_score(response, "95") == expected


def test_arithmetic_negative_answer():
    assert arithmetic_score("-3", "-3") == 1.0 and arithmetic_score("3", "-3") == 0.0


@pytest.mark.parametrize("source, scorer", [
    ("openai/gsm8k", gsm8k_score), ("gsm8k", gsm8k_score), ("lighteval/MATH", math_score),
    ("DigitalLearningGmbH/MATH-lighteval", math_score), ("math", math_score),
    ("countdown", countdown_score), ("arithmetic", arithmetic_score),
])
def test_get_scorer_by_verl_data_source(source, scorer):
    assert get_scorer(source) is scorer


def test_unknown_data_source_lists_known_names():
    with pytest.raises(ValueError, match=r"no reward scorer for data_source 'nope'.*arithmetic"):
        get_scorer("nope")
    assert default_compute_score("gsm8k", "#### 2", "2") == 1.0
