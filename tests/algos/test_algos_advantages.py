"""Advantage estimators: hand-computed values and verl-style loop references (plain numpy)."""
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algos

# A batch with every awkward case: big non-contiguous unsorted ids, a group of one (42), a
# group with identical scores (5), a mixed group (900001), an empty response (row 7), padding.
IDS = np.array([900001, 5, 900001, 42, 5, 5, 900001, 77777], np.int32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1],
                 [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
SCORES = np.array([1.0, 0.5, 0.0, 2.0, 0.5, 0.5, 0.0, 3.0], np.float32)


def _rewards(scores=SCORES, mask=MASK):
    """Outcome reward on the last response token (and on token 0 for empty rows)."""
    r = np.zeros(mask.shape, np.float32)
    last = np.maximum(mask.sum(-1).astype(int) - 1, 0)
    r[np.arange(len(scores)), last] = scores
    return r


def _groups(ids, values):
    out = defaultdict(list)
    for i, g in enumerate(ids):
        out[g].append(values[i])
    return out


def _whiten(x, m):
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * n / (n - 1)
    return (x - mean) / np.sqrt(var + 1e-8)


def ref_grpo(rewards, mask, ids, eps=1e-6, norm=True):
    scores = rewards.astype(np.float64).sum(-1)
    groups = _groups(ids, scores)
    out = np.zeros_like(scores)
    for i, g in enumerate(ids):
        vals = np.array(groups[g])
        mean, std = (0.0, 1.0) if len(vals) == 1 else (vals.mean(), vals.std(ddof=1))
        out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out[:, None] * mask


def ref_rloo(rewards, mask, ids):
    scores = rewards.astype(np.float64).sum(-1)
    groups = _groups(ids, scores)
    out = scores.copy()
    for i, g in enumerate(ids):
        n = len(groups[g])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - np.mean(groups[g]) * n / (n - 1)
    return out[:, None] * mask


def ref_opo(rewards, mask, ids):
    scores = rewards.astype(np.float64).sum(-1)
    lens = mask.sum(-1)
    sg, lg = _groups(ids, scores), _groups(ids, lens)
    out = np.zeros_like(scores)
    for i, g in enumerate(ids):
        s, ln = np.array(sg[g]), np.array(lg[g])
        base = 0.0 if len(s) == 1 else (ln * s).sum() / ln.sum()
        out[i] = scores[i] - base
    return out[:, None] * mask


def ref_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    next_v, last = np.zeros(b), np.zeros(b)
    adv = np.zeros((b, t))
    for k in reversed(range(t)):
        delta = rewards[:, k] + gamma * next_v - values[:, k]
        new = delta + gamma * lam * last
        next_v = values[:, k] * mask[:, k] + (1 - mask[:, k]) * next_v
        last = new * mask[:, k] + (1 - mask[:, k]) * last
        adv[:, k] = last
    return _whiten(adv, mask), adv + values


def ref_rpp(rewards, mask, gamma):
    b, t = rewards.shape
    ret, running = np.zeros((b, t)), np.zeros(b)
    for k in reversed(range(t)):
        running = rewards[:, k] + gamma * running
        ret[:, k] = running
        running = running * mask[:, k]
    return _whiten(ret, mask) * mask, ret


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_grpo_hand_values_for_group_of_three():
    # scores [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3) -> (2/3)/0.57735 = 1.1547, -0.57735.
    r = np.array([[1.0], [0.0], [0.0]], np.float32)
    adv, ret = algos.grpo(r, np.ones_like(r), np.array([3, 3, 3]))
    close(adv[:, 0], [1.1547, -0.57735, -0.57735], 1e-4)
    close(ret, adv)


def test_grpo_group_of_one_gets_mean0_std1_and_identical_group_gets_zero():
    adv, _ = algos.grpo(_rewards(), MASK, IDS)
    adv = np.asarray(adv)
    close(adv[3], 2.0 / (1 + 1e-6) * MASK[3])  # group of one: score / (1 + eps)
    close(adv[[1, 4, 5]], 0.0)  # identical scores
    close(adv[7], 0.0)  # empty response, masked out
    assert adv[0, 0] > 0 and adv[2, 0] < 0


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_verl_loop(norm):
    adv, _ = jax.jit(algos.grpo, static_argnames="norm_adv_by_std_in_grpo")(
        _rewards(), MASK, IDS, norm_adv_by_std_in_grpo=norm)
    close(adv, ref_grpo(_rewards(), MASK, IDS, norm=norm))


def test_grpo_passk_only_unique_best_gets_gap_over_std():
    # group 1: scores [3, 1, 2] -> best row 0 gets (3-2)/std([3,1,2]) = 1/1; group 2 tie -> 0.
    r = np.array([[3.0], [1.0], [2.0], [4.0], [4.0], [0.0]], np.float32)
    ids = np.array([10, 10, 10, -4, -4, -4])
    adv, _ = algos.grpo_passk(r, np.ones_like(r), ids)
    close(adv[:, 0], [1.0 / (1.0 + 1e-6), 0, 0, 0, 0, 0])
    adv_raw, _ = algos.grpo_passk(r, np.ones_like(r), ids, norm_adv_by_std_in_grpo=False)
    close(adv_raw[:, 0], [1.0, 0, 0, 0, 0, 0])


def test_grpo_passk_rejects_group_of_one_eagerly():
    with pytest.raises(ValueError, match="at least 2"):
        algos.grpo_passk(_rewards(), MASK, IDS)


def test_rloo_hand_values_and_singleton_keeps_raw_score():
    # group [1, 0, 2]: n/(n-1)*(s - mean) = 1.5 * [0, -1, 1]
    r = np.array([[1.0], [0.0], [2.0], [7.0]], np.float32)
    adv, _ = algos.rloo(r, np.ones_like(r), np.array([2, 2, 2, 99]))
    close(adv[:, 0], [0.0, -1.5, 1.5, 7.0])
    close(algos.rloo(_rewards(), MASK, IDS)[0], ref_rloo(_rewards(), MASK, IDS))


def test_opo_length_weighted_baseline():
    # lengths [3, 1], scores [1, 0]: baseline = 3/4 -> [0.25, -0.75]
    r = np.array([[0, 0, 1.0], [0, 0, 0]], np.float32)
    m = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
    adv, _ = algos.opo(r, m, np.array([8, 8]))
    close(adv, [[0.25, 0.25, 0.25], [-0.75, 0, 0]])
    close(algos.opo(_rewards(), MASK, IDS)[0], ref_opo(_rewards(), MASK, IDS))


def test_gae_hand_values_skip_masked_tokens():
    # gamma = lam = 1, rewards [0, 1, 0], values [.5, .5, 9], mask [1, 1, 0]:
    # raw advantages [.5, .5, 0] (padding value 9 is skipped), returns = adv + values.
    r = np.array([[0, 1.0, 0], [1.0, 0, 0]], np.float32)
    v = np.array([[0.5, 0.5, 9.0], [0.0, 0, 0]], np.float32)
    m = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    adv, ret = algos.gae(r, v, m, 1.0, 1.0)
    close(ret, [[1.0, 1.0, 9.0], [1.0, 0, 0]])
    raw = np.array([[0.5, 0.5, 0.0], [1.0, 0, 0]])
    close(adv, _whiten(raw, m), 1e-4)


def test_gae_matches_verl_loop_random():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(5, 7)).astype(np.float32)
    v = rng.normal(size=(5, 7)).astype(np.float32)
    m = (np.arange(7)[None] < rng.integers(1, 8, size=(5, 1))).astype(np.float32)
    adv, ret = jax.jit(algos.gae)(r, v, m, 0.99, 0.95)
    ref_adv, ref_ret = ref_gae(r, v, m, 0.99, 0.95)
    close(ret, ref_ret, 1e-4)
    close(adv, ref_adv, 1e-4)


def test_reinforce_plus_plus_matches_loop_and_resets_after_eos():
    r = np.array([[0, 0, 1.0, 5.0], [0, 2.0, 0, 0], [1.0, 0, 0, 0]], np.float32)
    m = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    adv, ret = algos.reinforce_plus_plus(r, m, gamma=0.5)
    # row 0: the 5.0 after EOS must not leak into the returns of real tokens
    close(np.asarray(ret)[0, :3], [0.25, 0.5, 1.0])
    ref_adv, ref_ret = ref_rpp(r, m, 0.5)
    close(ret, ref_ret)
    close(adv, ref_adv, 1e-4)


def test_reinforce_plus_plus_baseline_is_whitened_group_centred_score():
    adv, _ = algos.reinforce_plus_plus_baseline(_rewards(), MASK, IDS)
    scores = _rewards().sum(-1).astype(np.float64)
    g = _groups(IDS, scores)
    centred = np.array([s - (0.0 if len(g[i]) == 1 else np.mean(g[i])) for s, i in zip(scores, IDS)])
    tiled = centred[:, None] * MASK
    close(adv, _whiten(tiled, MASK) * MASK, 1e-4)


def test_remax_subtracts_baseline_from_return_to_go():
    r = np.array([[1.0, 2.0, 3.0], [0, 4.0, 9.0]], np.float32)
    m = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    adv, ret = algos.remax(r, np.array([1.0, 2.0], np.float32), m)
    close(ret, [[6, 5, 3], [4, 4, 0]])
    close(adv, [[5, 4, 2], [2, 2, 0]])


def test_gpg_scales_by_batch_over_nonzero_count():
    # scores [1, 0, 0, 3] in groups {a: 1, 0}, {b: 0}, {c: 3}: nonzero = 2, alpha = 4/2 = 2
    r = np.array([[1.0], [0.0], [0.0], [3.0]], np.float32)
    adv, _ = algos.gpg(r, np.ones_like(r), np.array([1, 1, 2, 3]), f_norm=0.5, alpha=123.0)
    close(adv[:, 0], [2 * 0.5 / 0.5, 2 * -0.5 / 0.5, 0.0, 2 * 3.0 / 0.5])


def test_registry_lists_every_verl_estimator_and_rejects_unknown():
    assert set(algos.ADV_ESTIMATORS) == {
        "gae", "grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "gpg"}
    with pytest.raises(KeyError, match="grpo"):
        algos.get_adv_estimator("grop")
    with pytest.raises(ValueError, match="Valid names"):
        algos.get_adv_estimator("nope")


def test_group_ids_need_not_be_sorted_or_small():
    perm = np.array([3, 0, 7, 1, 6, 2, 5, 4])
    adv, _ = algos.grpo(_rewards(), MASK, IDS)
    adv_p, _ = algos.grpo(_rewards()[perm], MASK[perm], IDS[perm] * 3 - 2**30)
    close(np.asarray(adv)[perm], adv_p)


def test_estimators_vmap_over_stacked_batches():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(3, 8, 4)).astype(np.float32)
    m = np.broadcast_to(MASK, r.shape)
    ids = np.stack([IDS, IDS[::-1], np.arange(8, dtype=np.int32)])
    out = jax.vmap(algos.grpo)(r, m, ids)[0]
    for k in range(3):
        close(out[k], ref_grpo(r[k], MASK, ids[k]))
    assert jnp.all(jnp.isfinite(out))


def _all_inputs(b=8, t=4):
    rng = np.random.default_rng(3)
    return dict(token_level_rewards=_rewards(), response_mask=MASK, group_ids=IDS,
                values=rng.normal(size=(b, t)).astype(np.float32),
                reward_baselines=rng.normal(size=b).astype(np.float32),
                gamma=1.0, lam=0.95, norm_adv_by_std_in_grpo=True)


@pytest.mark.parametrize("name", sorted(algos.ADV_ESTIMATORS))
def test_every_estimator_runs_through_one_keyword_signature(name):
    inputs = _all_inputs()
    if name == "grpo_passk":  # needs groups of 2+
        inputs["group_ids"] = np.repeat(np.arange(4, dtype=np.int32), 2)
    adv, ret = algos.compute_advantage(name, **inputs)
    assert adv.shape == ret.shape == MASK.shape and np.isfinite(np.asarray(adv)).all()


def test_compute_advantage_takes_each_estimators_own_inputs():
    inputs = _all_inputs()
    adv, _ = algos.compute_advantage("remax", **inputs)
    close(adv, algos.remax(inputs["token_level_rewards"], inputs["reward_baselines"], MASK)[0])
    adv, _ = algos.compute_advantage("grpo", **dict(inputs, norm_adv_by_std_in_grpo=False))
    close(adv, algos.grpo(_rewards(), MASK, IDS, norm_adv_by_std_in_grpo=False)[0])


def test_compute_advantage_names_a_missing_input_and_rejects_unknown_ones():
    inputs = _all_inputs()
    del inputs["reward_baselines"]
    with pytest.raises(ValueError, match="remax.*reward_baselines"):
        algos.compute_advantage("remax", **inputs)
    with pytest.raises(TypeError, match="index"):
        algos.compute_advantage("grpo", index=IDS, **inputs)
