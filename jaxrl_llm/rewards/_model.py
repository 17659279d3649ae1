"""A discriminative reward model as a streaming scoring service (verl's DisRM in its reward loop).

Trajectories finish one by one; each one's coroutine awaits `RewardModelService.score(prompt_ids,
response_ids)`. Requests queue up while a forward runs; one background thread takes everything
queued, lays it out as the trainer lays out a batch (prompt left-padded to `max_prompt_length`,
response right-padded to `max_response_length`: the shapes of the trainer's own scoring pass, so
the compiled forward is shared), calls `score_fn` once for all of them, and resolves each request.
So the value-head forward is batched over whatever finished together, on whichever devices
`score_fn` runs (the caller's choice: `workers.HostWorker` passes its `RewardModelWorker`, whose
micro-batching, `reward.model.use_dynamic_bsz` token budget and packing apply unchanged).

Rows are padded up to a multiple of `row_multiple` (the scoring pass's micro-batch: data-parallel
devices x micro-batch rows) with copies of the first row, so a forward never sees a row count it
cannot split; their scores are dropped.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import numpy as np


class RewardModelService:
    """`await service.score(prompt_ids, response_ids)` -> the reward model's sequence score.

    score_fn: a batch dict (`input_ids`, `attention_mask`, `position_ids` int32[b, p + t],
    `responses`, `response_mask` int32[b, t]) -> f32[b] sequence scores.
    """

    def __init__(self, score_fn: Callable[[dict[str, np.ndarray]], np.ndarray], *,
                 max_prompt_length: int, max_response_length: int, pad_token_id: int,
                 row_multiple: int = 1):
        self.score_fn = score_fn
        self.p, self.t, self.pad = int(max_prompt_length), int(max_response_length), int(pad_token_id)
        self.row_multiple = max(int(row_multiple), 1)
        self._queue: list = []  # (prompt_ids, response_ids, future, event loop)
        self._cv = threading.Condition()
        self._closed = False
        self.num_forwards = 0  # forwards run so far (a forward scores every request queued at its start)
        self.batch_sizes: list[int] = []  # real rows of each forward, in order
        self._thread = threading.Thread(target=self._serve, name="reward-model", daemon=True)
        self._thread.start()

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        if len(prompt_ids) > self.p or len(response_ids) > self.t:
            raise ValueError(f"reward model request of {len(prompt_ids)} prompt + {len(response_ids)} "
                             f"response tokens exceeds data.max_prompt_length={self.p} / "
                             f"data.max_response_length={self.t}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._closed:
                raise RuntimeError("RewardModelService is closed")
            self._queue.append((list(prompt_ids), list(response_ids), fut, loop))
            self._cv.notify()
        return await fut

    def batch(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, np.ndarray]:
        """(prompt ids, response ids) pairs -> the trainer's padded layout, rows padded to a
        multiple of `row_multiple` with copies of row 0."""
        n = -(-len(rows) // self.row_multiple) * self.row_multiple
        rows = list(rows) + [rows[0]] * (n - len(rows))
        ids = np.full((n, self.p + self.t), self.pad, np.int32)
        attn = np.zeros((n, self.p + self.t), np.int32)
        resp_mask = np.zeros((n, self.t), np.int32)
        for i, (prompt, response) in enumerate(rows):
            ids[i, self.p - len(prompt):self.p] = prompt
            ids[i, self.p:self.p + len(response)] = response
            attn[i, self.p - len(prompt):self.p + len(response)] = 1
            resp_mask[i, :len(response)] = 1
        pos = np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
        return {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                "responses": ids[:, self.p:].copy(), "response_mask": resp_mask}

    def _serve(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                taken, self._queue = self._queue, []
            try:
                scores = np.asarray(self.score_fn(self.batch([(p, r) for p, r, _, _ in taken])), np.float32)
                self.num_forwards += 1
                self.batch_sizes.append(len(taken))
                results = [(float(scores[i]), None) for i in range(len(taken))]
            except Exception as e:  # noqa: BLE001 - handed to every waiting trajectory
                results = [(None, e)] * len(taken)
            for (_, _, fut, loop), (value, err) in zip(taken, results):
                try:
                    loop.call_soon_threadsafe(_resolve, fut, value, err)
                except RuntimeError:  # that trajectory's event loop has ended: nobody waits
                    pass

    def close(self) -> None:
        """Scores what is queued, then stops the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()


def _resolve(fut: asyncio.Future, value, err) -> None:
    if fut.done():  # the awaiting trajectory was cancelled
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(value)
