"""Reading and encoding samples in background processes (``data.num_workers``), in the order asked.

Workers start from multiprocessing's fork server, a clean single-threaded process (forking the trainer
itself would copy locks its threads hold), and receive the dataset and encoder once, from this process
(file offsets, settings, the tokenizer's model: no file is unpickled); then only sample indices, over a pipe of
their own. Each returns the encoded sample (NumPy arrays) or the reason it is unusable, with the counts the
encoder kept while encoding it. At most ``depth`` samples are in flight, so a slow consumer holds a bounded
number of decoded images.

A worker that dies (the kernel's out-of-memory killer, say) is noticed at once, through its process sentinel,
not by waiting: a new worker takes its place and redoes its samples, in the same order, so the rows do not
change. After ``max_restarts`` deaths the run stops with a :class:`~.sample.DataError` naming the last one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import Counter, deque
from multiprocessing.connection import wait

from ... import faults
from ..formats.sample import BadSample, DataError


def _serve(conn, dataset, encoder, generation: int, fault: str | None) -> None:
    """A worker: (sequence number, sample index) in, (sequence number, encoded or None, reason, counts, the message
    of a data error that ends the run or None) out.
    ``fault``: the trainer's injected fault (the fork server's environment is the one it started with)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides what an interrupt means
    if fault:
        os.environ[faults.VARIABLE] = fault
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        number, index = message
        if generation == 0:  # a first worker only, so that the one redoing its samples lives on
            faults.hit("kill_worker", index, 0)
        faults.hit("kill_every_worker", index, 0)
        encoder.stats = Counter()
        try:
            conn.send((number, encoder(dataset[index]), None, encoder.stats, None))
        except BadSample as bad:
            conn.send((number, None, bad.reason, encoder.stats, None))
        except DataError as err:  # the run cannot go on: the trainer raises it
            conn.send((number, None, None, encoder.stats, str(err)))


def encode_in_order(dataset, encoder, indices, workers: SampleWorkers | None, stats: Counter):
    """(index, encoded sample or None, the reason it is unusable or None) for each index, in order: by
    ``workers`` when there are any, in this process otherwise."""
    if workers is not None:
        yield from workers.encoded(indices, stats)
        return
    for index in indices:
        try:
            yield index, encoder(dataset[index]), None
        except BadSample as bad:
            yield index, None, bad.reason


class _Worker:
    def __init__(self, context, dataset, encoder, generation: int):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, daemon=True,
                                       args=(child, dataset, encoder, generation, os.environ.get(faults.VARIABLE)))
        self.process.start()
        child.close()
        self.queue: deque = deque()  # (sequence number, index) sent and not yet answered, in order


class SampleWorkers:
    def __init__(self, dataset, encoder, workers: int, depth_per_worker: int = 4, max_restarts: int = 3):
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload([__name__])  # the server imports the data code once; workers fork
        self.dataset, self.encoder = dataset, encoder
        self.workers = [_Worker(self.context, dataset, encoder, 0) for _ in range(workers)]
        self.depth = workers * depth_per_worker
        self.max_restarts, self.restarts = max_restarts, 0
        self.sent = 0

    def encoded(self, indices, stats: Counter):
        """(index, encoded sample or None, reason it is unusable or None) for each index, in order."""
        pending: deque = deque()  # (sequence number, index, worker) in the order asked
        answers: dict = {}
        indices = iter(indices)

        def send(index) -> None:
            worker = self.workers[self.sent % len(self.workers)]
            try:
                worker.conn.send((self.sent, index))
            except OSError:  # it died: noticed when its answer is awaited, and the queue is sent again
                pass
            worker.queue.append((self.sent, index))
            pending.append((self.sent, index, worker))
            self.sent += 1

        for index in indices:
            send(index)
            if len(pending) >= self.depth:
                break
        while pending:
            number, index, worker = pending.popleft()
            while number not in answers:
                self._receive(worker, answers)
            following = next(indices, None)
            if following is not None:
                send(following)
            encoded, reason, counts, fatal = answers.pop(number)
            if fatal is not None:
                raise DataError(fatal)
            stats.update(counts)
            yield index, encoded, reason

    def _receive(self, worker: _Worker, answers: dict) -> None:
        """One answer of ``worker`` into ``answers``; if it died, what it had sent, then a new worker in its place
        with its unanswered samples."""
        wait([worker.conn, worker.process.sentinel])
        if worker.conn.poll():
            try:
                number, *answer = worker.conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed with the process
                pass
            else:
                answers[number] = answer
                worker.queue.popleft()
                return
        if worker.process.is_alive():
            return
        worker.process.join()
        self.restarts += 1
        code = worker.process.exitcode
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
        if self.restarts > self.max_restarts:
            raise DataError(f"a data worker died {self.restarts} times (the last {how}; SIGKILL is often the "
                            "system's out-of-memory killer): lower data.num_workers or the images' size")
        replacement = _Worker(self.context, self.dataset, self.encoder, self.restarts)
        worker.conn.close()
        worker.conn, worker.process = replacement.conn, replacement.process
        for message in worker.queue:  # in the order they were asked
            worker.conn.send(message)
        print(f"data: a worker died ({how}); a new one redoes its {len(worker.queue)} sample(s)", flush=True)

    def close(self) -> None:
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self.workers:
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.terminate()
