"""Policy / value losses, aggregation, KL and KL controllers: hand values and exactness."""
import jax
import numpy as np
import pytest

from jaxrl_llm import algos


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


LOSS_MAT = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], np.float32)
LOSS_MASK = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], np.float32)  # row 2 is empty


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4),
    ("seq-mean-token-sum", 10 / 2),
    ("seq-mean-token-mean", (2 + 4) / 2),
    ("seq-mean-token-sum-norm", 10 / 2 / 3),
    ("token-sum", 10.0),
])
def test_agg_loss_hand_values_exclude_empty_rows(mode, expected):
    close(algos.agg_loss(LOSS_MAT, LOSS_MASK, mode), expected)


def test_agg_loss_ignores_nan_under_the_mask_and_all_empty_batch_is_zero():
    mat = LOSS_MAT.copy()
    mat[2] = np.nan
    close(algos.agg_loss(mat, LOSS_MASK, "token-mean"), 2.5)
    close(algos.agg_loss(LOSS_MAT, np.zeros_like(LOSS_MASK), "seq-mean-token-mean"), 0.0)


def test_agg_loss_sum_norm_uses_loss_scale_factor():
    close(algos.agg_loss(LOSS_MAT, LOSS_MASK, "seq-mean-token-sum-norm", loss_scale_factor=10),
          10 / 2 / 10)


def test_agg_loss_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        algos.agg_loss(LOSS_MAT, LOSS_MASK, "token-median")


def _random_batch(seed=0, b=8, t=6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[1] = 0  # an empty response
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    old = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
    new = (old + rng.normal(scale=0.3, size=(b, t))).astype(np.float32)
    adv = rng.normal(size=(b, t)).astype(np.float32)
    return old, new, adv, mask


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_micro_batch_sum_and_count_equals_full_batch(mode):
    _, new, _, mask = _random_batch(1)
    full = algos.agg_loss(new, mask, mode)
    parts = [algos.agg_loss_terms(new[i:i + 2], mask[i:i + 2], mode) for i in range(0, 8, 2)]
    num = sum(p[0] for p in parts)
    den = sum(p[1] for p in parts)
    close(num if mode == "token-sum" else num / den, full)  # token-sum: no normaliser to add
    # verl's way: divide each micro-batch by the global count, then add.
    g = sum(algos.agg_loss_denominator(mask[i:i + 2], mode) for i in range(0, 8, 2))
    kw = {"global_token_count": g} if mode == "token-mean" else {"global_batch_size": g}
    shares = sum(algos.agg_loss(new[i:i + 2], mask[i:i + 2], mode, **kw) for i in range(0, 8, 2))
    close(shares, full)


def test_token_sum_ignores_global_counts():
    close(algos.agg_loss(LOSS_MAT, LOSS_MASK, "token-sum", global_token_count=7.0,
                         global_batch_size=3.0), 10.0)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean"])
def test_policy_loss_micro_batch_gradients_equal_full_batch(name):
    old, new, adv, mask = _random_batch(2)  # row 1 is empty
    mode = "seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean"
    fn = algos.get_policy_loss(name)
    key = "global_token_count" if mode == "token-mean" else "global_batch_size"
    if name == "geo_mean":  # a mean over all rows, the empty one included (verl)
        key = "global_row_count"

    @jax.jit
    def loss_and_grad(lp, old, adv, mask, den):
        return jax.value_and_grad(lambda x: fn(old, x, adv, mask, mode, **{key: den})[0])(lp)

    full_den = (np.float32(mask.shape[0]) if key == "global_row_count"
                else algos.agg_loss_denominator(mask, mode))
    full_loss, grad_full = loss_and_grad(new, old, adv, mask, full_den)
    close(full_loss, fn(old, new, adv, mask, mode)[0])  # global count = own count
    parts = [loss_and_grad(new[s], old[s], adv[s], mask[s], full_den)
             for s in (slice(0, 4), slice(4, 8))]
    close(sum(p[0] for p in parts), full_loss)
    close(np.concatenate([p[1] for p in parts]), grad_full)


def test_vanilla_ppo_hand_values_with_dual_clip():
    # tokens: (A=1, r=1.5) -> -1.2 clipped; (A=-1, r=4) -> dual clip caps at 3;
    #         (A=-1, r=0.5) -> 0.8 clipped; (A=2, r=1) -> -2.
    lp = np.log(np.array([[1.5, 4.0, 0.5, 1.0]], np.float32))
    old = np.zeros_like(lp)
    adv = np.array([[1.0, -1.0, -1.0, 2.0]], np.float32)
    mask = np.ones_like(lp)
    loss, m = algos.POLICY_LOSSES["vanilla"](old, lp, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    close(loss, (-1.2 + 3.0 + 0.8 - 2.0) / 4)
    close(m["pg_clipfrac"], 0.5)
    close(m["pg_clipfrac_lower"], 0.25)
    close(m["ppo_kl"], -np.log(3.0) / 4)
    # clip-higher: with clip_ratio_high=0.6 the first token is no longer clipped.
    loss_hi, _ = algos.POLICY_LOSSES["vanilla"](old, lp, adv, mask, clip_ratio=0.2,
                                                clip_ratio_high=0.6)
    close(loss_hi, (-1.5 + 3.0 + 0.8 - 2.0) / 4)


def test_vanilla_rejects_clip_ratio_c_at_most_one_and_unknown_keywords():
    old, new, adv, mask = _random_batch()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.POLICY_LOSSES["vanilla"](old, new, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(TypeError, match="clip_ratoi"):
        algos.POLICY_LOSSES["vanilla"](old, new, adv, mask, clip_ratoi=0.2)
    # another loss's hyper-parameter is accepted and ignored
    algos.POLICY_LOSSES["vanilla"](old, new, adv, mask, tau_pos=2.0)


def _np_vanilla(old, new, adv, mask, lo=0.2, hi=0.28, c=3.0):
    r = np.exp(np.clip(new - old, -20, 20))
    l1, l2 = -adv * r, -adv * np.clip(r, 1 - lo, 1 + hi)
    cl = np.maximum(l1, l2)
    pg = np.where(adv < 0, np.minimum(-adv * c, cl), cl)
    return (pg * mask).sum() / mask.sum()


def test_vanilla_matches_numpy_formula_random():
    old, new, adv, mask = _random_batch(3)
    loss, _ = algos.POLICY_LOSSES["vanilla"](old, new, adv, mask, clip_ratio=0.2,
                                             clip_ratio_high=0.28)
    close(loss, _np_vanilla(old, new, adv, mask))


def test_rollout_is_weights_multiply_the_token_loss():
    old, new, adv, mask = _random_batch(4)
    w = np.random.default_rng(0).uniform(0.5, 2.0, size=mask.shape).astype(np.float32)
    for name in ["vanilla", "cispo", "gpg"]:
        fn = algos.POLICY_LOSSES[name]
        a = fn(old, new, adv, mask, rollout_is_weights=w)[0]
        b = fn(old, new, adv, mask, rollout_is_weights=np.ones_like(w))[0]
        assert not np.isclose(a, b), name
    close(algos.POLICY_LOSSES["gpg"](old, new, adv, mask, rollout_is_weights=w)[0],
          (-new * adv * w * mask).sum() / mask.sum())


def test_gspo_value_is_sequence_ratio_and_gradient_flows_per_token():
    # one row of 2 tokens: d = [0.1, 0.3] -> s = exp(0.2); A = 1 (unclipped with clip 0.5)
    old = np.zeros((1, 3), np.float32)
    new = np.array([[0.1, 0.3, 5.0]], np.float32)
    adv = np.ones_like(new)
    mask = np.array([[1, 1, 0]], np.float32)
    fn = algos.POLICY_LOSSES["gspo"]
    loss, _ = fn(old, new, adv, mask, "token-mean", clip_ratio=0.5)
    close(loss, -np.exp(0.2))
    grad = jax.grad(lambda lp: fn(old, lp, adv, mask, clip_ratio=0.5)[0])(new)
    close(grad, [[-np.exp(0.2) / 2, -np.exp(0.2) / 2, 0.0]])


def test_gspo_and_sapo_always_aggregate_seq_mean_token_mean():
    old, new, adv, mask = _random_batch(5)
    for name in ["gspo", "sapo"]:
        fn = algos.POLICY_LOSSES[name]
        close(fn(old, new, adv, mask, "token-mean")[0],
              fn(old, new, adv, mask, "seq-mean-token-sum")[0])


def test_sapo_soft_gate_hand_value():
    # r = 1 -> gate = sigmoid(0) * 4 / tau = 2 / tau; A=1 uses tau_pos=1, A=-1 uses tau_neg=2
    z = np.zeros((2, 1), np.float32)
    adv = np.array([[1.0], [-1.0]], np.float32)
    loss, _ = algos.POLICY_LOSSES["sapo"](z, z, adv, np.ones_like(z), tau_pos=1.0, tau_neg=2.0)
    close(loss, (-2.0 + 1.0) / 2)


def test_cispo_gradient_uses_stopped_clipped_ratio():
    old = np.zeros((1, 2), np.float32)
    new = np.log(np.array([[2.0, 0.9]], np.float32))
    adv = np.array([[1.0, -2.0]], np.float32)
    mask = np.ones_like(new)
    fn = algos.POLICY_LOSSES["cispo"]
    loss, m = fn(old, new, adv, mask, clip_ratio=0.2)
    close(loss, (-1.2 * 1.0 * np.log(2.0) + 0.9 * 2.0 * np.log(0.9)) / 2)
    close(m["pg_clipfrac"], 0.5)
    grad = jax.grad(lambda lp: fn(old, lp, adv, mask, clip_ratio=0.2)[0])(new)
    close(grad, [[-1.2 / 2, 0.9 * 2.0 / 2]])


def test_geo_mean_hand_value_and_row_mean():
    # row 0: A=1, d=[0.1, 0.5] clipped to [0.1, 0.2] -> ratio exp(0.15); row 1 empty
    old = np.zeros((2, 2), np.float32)
    new = np.array([[0.1, 0.5], [0.0, 0.0]], np.float32)
    adv = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
    mask = np.array([[1, 1], [0, 0]], np.float32)
    loss, m = algos.POLICY_LOSSES["geo_mean"](old, new, adv, mask, clip_ratio=0.2)
    close(loss, -np.exp(0.15) / 2, 1e-4)
    close(m["pg_clipfrac"], 0.5)


def test_all_verl_policy_losses_registered_and_jit_with_same_metric_keys():
    assert {"vanilla", "gspo", "gpg", "cispo", "geo_mean", "sapo"} <= set(algos.POLICY_LOSSES)
    old, new, adv, mask = _random_batch(6)
    for name, fn in algos.POLICY_LOSSES.items():
        loss, metrics = jax.jit(lambda *a, f=fn: f(*a))(old, new, adv, mask)
        assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}, name
        assert np.isfinite(loss), name
    with pytest.raises(KeyError, match="vanilla"):
        algos.get_policy_loss("ppo")


def test_value_loss_hand_values():
    vpreds = np.array([[1.0, 0.0]], np.float32)
    values = np.zeros_like(vpreds)
    returns = np.array([[1.0, 1.0]], np.float32)
    # clip 0.2: v_clip = [0.2, 0]; losses max([0, 1], [0.64, 1]) = [0.64, 1]
    vf, frac = algos.value_loss(vpreds, returns, values, np.ones_like(vpreds), 0.2)
    close(vf, 0.5 * (0.64 + 1.0) / 2)
    close(frac, 0.5)


KL_LP, KL_REF = np.log(np.float32([[0.5]])), np.log(np.float32([[0.25]]))


@pytest.mark.parametrize("kind, expected", [
    ("kl", np.log(2)), ("k1", np.log(2)), ("abs", np.log(2)),
    ("mse", 0.5 * np.log(2) ** 2), ("k2", 0.5 * np.log(2) ** 2),
    ("low_var_kl", 0.5 + np.log(2) - 1), ("k3", 0.5 + np.log(2) - 1),
])
def test_kl_penalty_hand_values(kind, expected):
    close(algos.kl_penalty(KL_LP, KL_REF, kind), [[expected]])


def test_kl_low_var_clamps_and_straight_through_gradient():
    lp, ref = np.float32([[0.0]]), np.float32([[-50.0]])
    close(algos.kl_penalty(lp, ref, "k3"), [[10.0]])  # clamped
    close(algos.kl_penalty(KL_LP, KL_REF, "k3+"), algos.kl_penalty(KL_LP, KL_REF, "k3"))
    g = jax.grad(lambda x: algos.kl_penalty(x, KL_REF, "k3+").sum())(KL_LP)
    close(g, KL_LP - KL_REF)  # gradient of k2
    with pytest.raises(ValueError, match="low_var_kl"):
        algos.kl_penalty(KL_LP, KL_REF, "full")


def test_apply_kl_penalty_subtracts_beta_kl_on_response_tokens():
    scores = np.float32([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    old = np.float32([[0.2, 0.4, 9.0], [0.0, 0.0, 0.0]])
    ref = np.zeros_like(old)
    mask = np.float32([[1, 1, 0], [0, 0, 0]])
    rewards, kl = algos.apply_kl_penalty(scores, old, ref, mask, 0.5, "kl")
    close(rewards, [[-0.1, 0.8, 0.0], [2.0, 0.0, 0.0]])
    close(kl, (0.3 + 0.0) / 2)  # row means [0.3, 0 (empty)], batch mean


def test_adaptive_kl_controller_update_rule_and_pytree():
    ctl = algos.get_kl_controller("adaptive", 0.1, target_kl=6.0, horizon=10000)
    new = jax.jit(lambda c: c.update(9.0, 256))(ctl)
    close(new.value, 0.1 * (1 + 0.2 * 256 / 10000))  # error clipped to +0.2
    low = ctl.update(3.0, 100)
    close(low.value, 0.1 * (1 - 0.2 * 100 / 10000))  # error clipped to -0.2
    mid = ctl.update(6.6, 1000)
    close(mid.value, 0.1 * (1 + 0.1 * 1000 / 10000))
    assert len(jax.tree_util.tree_leaves(ctl)) == 1 and new.target == 6.0
    fixed = algos.get_kl_controller("fixed", 0.05)
    close(fixed.update(100.0, 10).value, 0.05)
    with pytest.raises(ValueError, match="horizon"):
        algos.get_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=0)
    with pytest.raises(KeyError, match="adaptive"):
        algos.get_kl_controller("pid", 0.1)
