"""An endless, resumable batch iterator over an `RLDataset`, built on grain.

The order is a pure function of (seed, epoch, position): grain's `MapDataset.shuffle` gives a
fresh deterministic permutation for every epoch, so the iterator's state is just two integers
and restoring it reproduces an uninterrupted run exactly. Tokenization is `_rl_dataset.py`'s job;
turning a batch into arrays is `collate_prompts`'.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PromptLoader:
    """Yields lists of `batch_size` examples forever, looping over epochs.

    `seed`/`shuffle` default to the dataset's own `seed`/`shuffle` attributes when it has them.
    With `drop_last` each epoch yields len(dataset) // batch_size full batches; without it the
    last batch of an epoch may be short. `get_state()` is JSON-serialisable:
    {"epoch", "position" (examples already served this epoch), "seed", "shuffle",
    "num_examples"}; `set_state` refuses a state from a different dataset size or seed.
    """

    def __init__(self, dataset: Sequence, batch_size: int, *, seed: int | None = None,
                 shuffle: bool | None = None, drop_last: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        n = len(dataset)
        if n == 0:
            raise ValueError("PromptLoader needs a non-empty dataset")
        if drop_last and n < batch_size:
            raise ValueError(f"dataset has {n} examples, fewer than batch_size={batch_size}; "
                             "lower the batch size (data.train_batch_size / data.val_batch_size) "
                             "or add rows")
        self._dataset = dataset
        self._batch_size = batch_size
        self._seed = int(getattr(dataset, "seed", 0) if seed is None else seed)
        self._shuffle = bool(getattr(dataset, "shuffle", True) if shuffle is None else shuffle)
        self._drop_last = drop_last
        import grain  # deferred: grain imports JAX, which scripts and scorers need not load

        order = grain.MapDataset.range(n)
        # Indexing past len(order) reads later epochs: grain reshuffles each one from the seed.
        self._order = order.shuffle(seed=self._seed) if self._shuffle else order.repeat()
        self._epoch = 0
        self._position = 0

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        n = len(self._dataset)
        return n // self._batch_size if self._drop_last else -(-n // self._batch_size)

    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> list[Any]:
        n = len(self._dataset)
        self._roll_over()
        start = self._epoch * n + self._position
        stop = start + min(self._batch_size, n - self._position)
        batch = [self._dataset[self._order[i]] for i in range(start, stop)]
        self._position += len(batch)
        self._roll_over()
        return batch

    def _roll_over(self) -> None:
        """Moves to the next epoch once this one cannot give another batch."""
        left = len(self._dataset) - self._position
        if left <= 0 or (self._drop_last and left < self._batch_size):
            self._epoch += 1
            self._position = 0

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed,
                "shuffle": self._shuffle, "num_examples": len(self._dataset)}

    def set_state(self, state: dict) -> None:
        for key in ("epoch", "position"):
            if key not in state:
                raise ValueError(f"PromptLoader state is missing {key!r}: {state}")
        expected = {"seed": self._seed, "shuffle": self._shuffle,
                    "num_examples": len(self._dataset)}
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise ValueError(f"PromptLoader state has {key}={state[key]!r} but this loader "
                                 f"has {key}={value!r}; the data or seed changed since the "
                                 "checkpoint")
        if not 0 <= int(state["position"]) <= len(self._dataset) or int(state["epoch"]) < 0:
            raise ValueError(f"PromptLoader state out of range: {state}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._roll_over()
