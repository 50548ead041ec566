"""Reading and encoding samples in background processes (``data.num_workers``), in the order asked.

Workers start from multiprocessing's fork server, a clean single-threaded process (forking the trainer
itself would copy locks its threads hold), and receive the dataset and encoder once, from this process
(file offsets, settings, the tokenizer's model: no file is unpickled); then only sample indices. Each returns
the encoded sample (NumPy arrays) or the reason it is unusable, with the counts the encoder kept while
encoding it. At most ``depth`` samples are in flight, so a slow consumer holds a bounded number of decoded
images.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter, deque

from .packing import BadSample

_encode = None  # a worker's (dataset, encoder)


def _start(dataset, encoder) -> None:
    global _encode
    _encode = (dataset, encoder)


def _work(index: int):
    dataset, encoder = _encode
    encoder.stats = Counter()
    try:
        return encoder(dataset[index]), None, encoder.stats
    except BadSample as bad:
        return None, bad.reason, encoder.stats


class SampleWorkers:
    def __init__(self, dataset, encoder, workers: int, depth_per_worker: int = 4):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # the server imports the data code once; workers fork from it
        self.pool = context.Pool(workers, initializer=_start, initargs=(dataset, encoder))
        self.depth = workers * depth_per_worker

    def encoded(self, indices, stats: Counter):
        """(index, encoded sample or None, reason it is unusable or None) for each index, in order."""
        pending: deque = deque()
        indices = iter(indices)
        for index in indices:
            pending.append((index, self.pool.apply_async(_work, (index,))))
            if len(pending) >= self.depth:
                break
        while pending:
            index, result = pending.popleft()
            following = next(indices, None)
            if following is not None:
                pending.append((following, self.pool.apply_async(_work, (following,))))
            encoded, reason, counts = result.get()
            stats.update(counts)
            yield index, encoded, reason

    def close(self) -> None:
        self.pool.terminate()
