"""PromptLoader: deterministic per-epoch shuffles and exact resumption from saved state."""
import itertools
import json

import pytest

from jaxrl_llm.data import PromptLoader


def _take(loader, n):
    return [list(batch) for batch in itertools.islice(loader, n)]


def test_same_seed_gives_same_order_across_runs_and_new_order_each_epoch():
    data = list(range(10))
    a = _take(PromptLoader(data, 3, seed=7), 9)  # 3 batches per epoch (drop_last)
    b = _take(PromptLoader(data, 3, seed=7), 9)
    assert a == b
    epochs = [sum(a[3 * e: 3 * e + 3], []) for e in range(3)]
    for epoch in epochs:
        assert len(set(epoch)) == 9 and set(epoch) <= set(data)
    assert epochs[0] != epochs[1]
    assert _take(PromptLoader(data, 3, seed=8), 3) != a[:3]


def test_restoring_state_mid_epoch_continues_like_an_uninterrupted_run():
    data = list(range(11))
    reference = _take(PromptLoader(data, 4, seed=1), 8)
    loader = PromptLoader(data, 4, seed=1)
    _take(loader, 4)  # 2 full batches per epoch: now at the start of epoch 2
    assert loader.epoch == 2 and loader.get_state()["position"] == 0
    _take(loader, 1)
    state = json.loads(json.dumps(loader.get_state()))
    assert state["epoch"] == 2 and state["position"] == 4
    resumed = PromptLoader(data, 4, seed=1)
    resumed.set_state(state)
    assert resumed.epoch == 2
    assert _take(resumed, 3) == reference[5:]


def test_no_shuffle_and_keep_last_partial_batch():
    loader = PromptLoader(list(range(5)), 2, seed=0, shuffle=False, drop_last=False)
    assert _take(loader, 4) == [[0, 1], [2, 3], [4], [0, 1]]
    assert loader.epoch == 1 and loader.batches_per_epoch == 3
    assert loader.get_state()["position"] == 2


def test_loader_uses_dataset_seed_and_rejects_foreign_state():
    class Data(list):
        seed, shuffle = 5, True

    data = Data(range(8))
    assert _take(PromptLoader(data, 2), 4) == _take(PromptLoader(list(range(8)), 2, seed=5), 4)
    loader = PromptLoader(data, 2)
    with pytest.raises(ValueError, match="num_examples"):
        loader.set_state({"epoch": 0, "position": 0, "num_examples": 9})
    with pytest.raises(ValueError, match="fewer than batch_size"):
        PromptLoader(list(range(3)), 4, seed=0)
