"""Rewards: rule-based scorers chosen by `data_source`, a custom function by path, a batch
scorer that survives failing or hanging scorers, and the streaming reward loop with its reward
model service and generative judge. (The reward model's forward lives in `jaxrl_llm.workers`.)"""
from jaxrl_llm.rewards._arithmetic import arithmetic_score
from jaxrl_llm.rewards._countdown import countdown_score, extract_countdown_equation
from jaxrl_llm.rewards._custom import CustomRewardFn, load_custom_reward_fn
from jaxrl_llm.rewards._gsm8k import extract_gsm8k_answer, gsm8k_score
from jaxrl_llm.rewards._judge import (
    TEMPLATE_FIELDS,
    Judge,
    Judgement,
    RewardWeights,
    check_template,
    combine_scores,
    judgement_metrics,
    make_score_parser,
    question_of,
    resolve_rule_weight,
)
from jaxrl_llm.rewards._loop import RewardLoop, RowScore, Trajectory
from jaxrl_llm.rewards._manager import RewardFunctionError, RewardManager
from jaxrl_llm.rewards._model import RewardModelService
from jaxrl_llm.rewards._math import (
    last_boxed_only_string,
    math_equal,
    math_score,
    normalize_math_answer,
    remove_boxed,
)
from jaxrl_llm.rewards._reasoning_gym import reasoning_gym_score
from jaxrl_llm.rewards._registry import (
    SCORERS,
    default_compute_score,
    get_scorer,
    normalize_result,
)

__all__ = [
    "SCORERS",
    "TEMPLATE_FIELDS",
    "CustomRewardFn",
    "Judge",
    "Judgement",
    "RewardLoop",
    "RewardFunctionError",
    "RewardManager",
    "RewardModelService",
    "RewardWeights",
    "RowScore",
    "Trajectory",
    "check_template",
    "combine_scores",
    "judgement_metrics",
    "make_score_parser",
    "question_of",
    "resolve_rule_weight",
    "arithmetic_score",
    "countdown_score",
    "default_compute_score",
    "extract_countdown_equation",
    "extract_gsm8k_answer",
    "get_scorer",
    "gsm8k_score",
    "last_boxed_only_string",
    "load_custom_reward_fn",
    "math_equal",
    "math_score",
    "normalize_math_answer",
    "normalize_result",
    "reasoning_gym_score",
    "remove_boxed",
]
