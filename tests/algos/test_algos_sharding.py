"""The algorithms give the same numbers on 1 device and with the batch sharded over 8."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm import algos

B, T, E, V = 16, 6, 8, 19


def _batch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[3] = 0
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    rewards = np.zeros((B, T), np.float32)
    rewards[:, -1] = rng.integers(0, 2, size=B)
    return dict(
        rewards=rewards, mask=mask,
        values=rng.normal(size=(B, T)).astype(np.float32),
        group_ids=(rng.permutation(B) // 4 * 1000003 + 17).astype(np.int32),
        old=-rng.uniform(0.1, 2.0, size=(B, T)).astype(np.float32),
        rollout=-rng.uniform(0.1, 2.0, size=(B, T)).astype(np.float32),
        hidden=rng.normal(size=(B, T, E)).astype(np.float32),
        unembed=rng.normal(size=(E, V)).astype(np.float32),
        tokens=rng.integers(0, V, size=(B, T)).astype(np.int32),
    )


def _pipeline(d):
    """One step of math: advantages, chunked log-probs, rollout weights, losses, gradients."""
    adv, _ = algos.grpo(d["rewards"], d["mask"], d["group_ids"])
    gae_adv, gae_ret = algos.gae(d["rewards"], d["values"], d["mask"], 0.99, 0.95)
    rloo_adv, _ = algos.rloo(d["rewards"], d["mask"], d["group_ids"])
    w, new_mask, corr = algos.rollout_correction(d["old"], d["rollout"], d["mask"],
                                                 rollout_is="token", rollout_rs="geometric",
                                                 rollout_rs_threshold=3.0)

    def actor_loss(hidden, unembed):
        logp, ent = algos.token_log_probs_from_hidden(hidden, unembed, d["tokens"],
                                                      chunk_size=4, return_entropy=True)
        loss, metrics = algos.POLICY_LOSSES["vanilla"](d["old"], logp, adv, new_mask,
                                                       "seq-mean-token-mean",
                                                       rollout_is_weights=w)
        return loss - 0.01 * algos.agg_loss(ent, new_mask, "token-mean"), metrics

    (loss, metrics), grads = jax.value_and_grad(actor_loss, argnums=(0, 1), has_aux=True)(
        d["hidden"], d["unembed"])
    vf, _ = algos.value_loss(d["values"] * 0.5, gae_ret, d["values"], d["mask"], 0.2)
    keep = algos.dynamic_sampling_keep_mask(d["rewards"].sum(-1), d["group_ids"])
    return dict(adv=adv, gae=gae_adv, rloo=rloo_adv, loss=loss, grads=grads, vf=vf, keep=keep,
                kl=corr["rollout_corr/kl"], ess=corr["rollout_corr/rollout_is_eff_sample_size"],
                **metrics)


def test_one_device_and_eight_device_batch_sharding_agree():
    assert len(jax.devices()) == 8, "tests/conftest.py should provide 8 CPU devices"
    data = _batch()
    step = jax.jit(_pipeline)
    one = jax.device_put(data, jax.devices()[0])
    ref = jax.device_get(step(one))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    row = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    sharded = {k: jax.device_put(v, rep if k == "unembed" else row) for k, v in data.items()}
    assert len(sharded["rewards"].sharding.device_set) == 8
    out = jax.device_get(step(sharded))

    flat_ref, tree_ref = jax.tree_util.tree_flatten(ref)
    flat_out, tree_out = jax.tree_util.tree_flatten(out)
    assert tree_ref == tree_out
    for a, b in zip(flat_ref, flat_out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.isfinite(ref["loss"]) and np.abs(np.asarray(ref["grads"][1])).sum() > 0


def test_policy_loss_vmaps_over_stacked_micro_batches():
    d = _batch()
    adv = jnp.asarray(d["rewards"]) - 0.5
    fn = algos.POLICY_LOSSES["cispo"]
    stack = lambda x: jnp.asarray(x).reshape(4, B // 4, T)
    losses, _ = jax.vmap(lambda o, lp, a, m: fn(o, lp, a, m, "token-mean"))(
        stack(d["old"]), stack(d["rollout"]), stack(adv), stack(d["mask"]))
    for k in range(4):
        s = slice(k * 4, k * 4 + 4)
        expected = fn(d["old"][s], d["rollout"][s], adv[s], d["mask"][s])[0]
        np.testing.assert_allclose(losses[k], expected, rtol=1e-6)
