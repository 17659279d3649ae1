"""The math of RL post-training as pure, jit-able JAX functions (verl's ``core_algos``).

Advantage estimators, policy and value losses, KL estimators and controllers, loss
aggregation (with an exact micro-batch form), chunked log-probs / entropy, rollout
correction and DAPO helpers. Names and numbers follow verl; ``group_ids: int[b]`` replaces
verl's ``index`` uid strings. Workers and the trainer call these; nothing here holds state
or reads a config object. See ``docs/algorithms.md`` for the formulas.
"""
from jaxrl_llm.algos._advantages import (
    ADV_ESTIMATORS,
    ADV_INPUTS,
    compute_advantage,
    gae,
    get_adv_estimator,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from jaxrl_llm.algos._aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_loss_denominator,
    agg_loss_terms,
)
from jaxrl_llm.algos._dapo import (
    dynamic_sampling_keep_mask,
    overlong_penalty,
    sequence_scores_to_token_level,
)
from jaxrl_llm.algos._kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from jaxrl_llm.algos._logprobs import (
    entropy_from_logits,
    project_logits,
    token_log_probs_from_hidden,
    token_log_probs_from_logits,
)
from jaxrl_llm.algos._masked import (
    group_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from jaxrl_llm.algos._policy_losses import (
    ACTOR_HYPER_NAMES,
    POLICY_LOSSES,
    get_policy_loss,
)
from jaxrl_llm.algos._registry import UnknownNameError
from jaxrl_llm.algos._rollout_correction import (
    rollout_correction,
    rollout_is_weights,
    rollout_offpolicy_metrics,
    rollout_rejection_mask,
)
from jaxrl_llm.algos._value_loss import value_loss

__all__ = [
    "ACTOR_HYPER_NAMES", "ADV_ESTIMATORS", "ADV_INPUTS", "AdaptiveKLController", "FixedKLController",
    "KL_PENALTIES", "LOSS_AGG_MODES", "POLICY_LOSSES", "UnknownNameError", "agg_loss",
    "agg_loss_denominator", "agg_loss_terms", "apply_kl_penalty", "compute_advantage",
    "dynamic_sampling_keep_mask",
    "entropy_from_logits", "gae", "get_adv_estimator", "get_kl_controller", "get_policy_loss",
    "gpg", "group_index", "grpo", "grpo_passk", "kl_penalty", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "opo", "overlong_penalty", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "rloo", "rollout_correction",
    "rollout_is_weights", "rollout_offpolicy_metrics", "rollout_rejection_mask",
    "sequence_scores_to_token_level", "token_log_probs_from_hidden", "project_logits",
    "token_log_probs_from_logits", "value_loss",
]
