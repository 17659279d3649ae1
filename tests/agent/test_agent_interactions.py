"""Interactions: answer_check's retry flow and scores, and loading from verl's config."""
import asyncio
import json

import pytest

from jaxrl_llm.agent.interactions import (
    AnswerCheckInteraction,
    BaseInteraction,
    answers_match,
    get_interaction_class,
    last_number,
    load_interactions,
)


def run(coro):
    return asyncio.run(coro)


def turn(interaction, instance_id, history, answer):
    history.append({"role": "assistant", "content": answer})
    return run(interaction.generate_response(instance_id, history))


def test_answer_check_retries_until_correct_then_scores_one():
    interaction = AnswerCheckInteraction({"max_attempts": 3})
    instance_id = run(interaction.start_interaction(ground_truth="72", query="ignored"))
    history = [{"role": "user", "content": "How many?"}]
    assert turn(interaction, instance_id, history, "I think 70.") == (
        False, "Your answer is wrong. Please try again.", 0.0, {"attempts": 1, "answer": "70"})
    assert run(interaction.calculate_score(instance_id)) == 0.0
    history.append({"role": "user", "content": "Your answer is wrong. Please try again."})
    assert turn(interaction, instance_id, history, "So it is 72.") == (
        True, "Your answer is correct!", 1.0, {"attempts": 2, "answer": "72"})
    assert run(interaction.calculate_score(instance_id)) == 1.0
    run(interaction.finalize_interaction(instance_id))
    with pytest.raises(KeyError, match="start_interaction first"):
        run(interaction.calculate_score(instance_id))


def test_answer_check_stops_after_max_attempts():
    interaction = AnswerCheckInteraction({"max_attempts": 2})
    instance_id = run(interaction.start_interaction(ground_truth=5))
    history = []
    assert turn(interaction, instance_id, history, "4")[:3] == (
        False, "Your answer is wrong. Please try again.", 0.0)
    assert turn(interaction, instance_id, history, "no idea")[:3] == (
        True, "Your answer is wrong.", 0.0)


def test_answer_check_keeps_instances_apart():
    interaction = AnswerCheckInteraction()
    a = run(interaction.start_interaction(ground_truth="1"))
    b = run(interaction.start_interaction(ground_truth="2"))
    assert a != b
    assert turn(interaction, a, [], "2")[2] == 0.0 and turn(interaction, b, [], "2")[2] == 1.0
    assert run(interaction.calculate_score(a)) == 0.0


def test_answer_check_reads_content_parts_and_needs_ground_truth():
    interaction = AnswerCheckInteraction()
    instance_id = run(interaction.start_interaction("fixed-id", ground_truth="1,000"))
    assert instance_id == "fixed-id"
    message = {"role": "assistant", "content": [{"type": "text", "text": "It is $1000"}]}
    assert run(interaction.generate_response(instance_id, [message]))[0] is True
    with pytest.raises(ValueError, match="needs ground_truth"):
        run(interaction.start_interaction())


def first_word_upper(text):
    return text.split()[0].upper()


def test_answer_check_uses_a_configured_extractor_by_path():
    interaction = AnswerCheckInteraction({"answer_extractor": f"{__name__}.first_word_upper"})
    instance_id = run(interaction.start_interaction(ground_truth="PARIS"))
    assert turn(interaction, instance_id, [], "paris is my answer")[:3] == (
        True, "Your answer is correct!", 1.0)


@pytest.mark.parametrize("text, number", [
    ("first 3 then 4.5", "4.5"), ("total: 1,234", "1,234"), ("-7 degrees", "-7"),
    ("costs $12", "$12"), ("no numbers", None),
])
def test_last_number_finds_the_last_number(text, number):
    assert last_number(text) == number


def test_answers_match_is_numeric_when_possible():
    assert answers_match("1,234.0", "1234") and answers_match("$5", 5)
    assert not answers_match("5", "6") and not answers_match(None, "6")
    assert answers_match(" yes", "yes") and not answers_match("yes", "no")


def test_answer_check_refuses_bad_config():
    with pytest.raises(ValueError, match="max_attemps"):
        AnswerCheckInteraction({"max_attemps": 2})
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        AnswerCheckInteraction({"max_attempts": 0})


class _Echo(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return True, messages[-1]["content"], 0.0, {}


def test_load_interactions_builds_builtin_and_custom_by_name(tmp_path):
    path = tmp_path / "interaction.json"
    path.write_text(json.dumps({"interaction": [
        {"name": "checker", "class_name": "answer_check", "config": {"max_attempts": 2}},
        {"class_name": f"{__name__}._Echo"},
    ]}))
    interactions = load_interactions(path)
    assert list(interactions) == ["checker", "_echo"]
    assert isinstance(interactions["checker"], AnswerCheckInteraction)
    assert interactions["checker"].max_attempts == 2 and interactions["checker"].name == "checker"
    assert run(interactions["_echo"].generate_response("i", [{"content": "hi"}]))[1] == "hi"


@pytest.mark.parametrize("data, error", [
    ({"interactions": []}, "list under 'interaction'"),
    ({"interaction": [{"name": "x"}]}, "needs 'class_name'"),
    ({"interaction": [{"class_name": "answer_chek"}]}, "unknown interaction 'answer_chek'"),
    ({"interaction": [{"class_name": "json.JSONDecoder"}]}, "not a subclass"),
    ({"interaction": [{"class_name": "answer_check"}, {"class_name": "answer_check"}]},
     "two interactions are named 'answer_check'"),
])
def test_load_interactions_errors_name_the_problem(tmp_path, data, error):
    path = tmp_path / "interaction.json"
    path.write_text(json.dumps(data))
    with pytest.raises((ValueError, TypeError), match=error):
        load_interactions(path)


def test_get_interaction_class_finds_builtin():
    assert get_interaction_class("answer_check") is AnswerCheckInteraction
