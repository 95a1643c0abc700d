"""The quality model's training passes: fastText's supervised SGD (``Model::update``, softmax loss over
two labels, the learning rate falling linearly to zero), on one core or on several at once.

One core (``workers`` 1): the examples in a seeded shuffle every epoch; the same inputs and seed give
the same bytes. Several: Hogwild, as fastText's threads train (Recht et al. 2011): the matrices in
shared memory, one forked process per share of the examples, each with its own shuffle and its own
learning-rate schedule, all writing without locks. A document touches a few hundred of a million
rows, so two processes rarely write the same row at once; the result differs from run to run in
its last digits, as fastText's does with more than one thread.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import random
import signal
import time

import numpy as np

from ..errors import DataPrepError

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_SIGNS = np.array([1.0, -1.0], np.float32)  # the two labels' rows move in opposite directions
MIN_PER_WORKER = 1000  # examples a process: below it, forking costs more than it saves


def step(inp: np.ndarray, out: np.ndarray, rows: np.ndarray, weights: np.ndarray, positive: bool, lr: float) -> None:
    """One example's step. ``rows``: a line's distinct input rows, ``weights`` each one's count over
    the line's, so that the hidden vector is one matrix-vector product and the input rows one gather
    and one store (``np.add.at`` over repeated rows, then a sum over an axis, had taken 3 of every 4
    seconds): the output rows move along the hidden vector, the input rows by the gradient, each by
    its share of the line."""
    sub = inp[rows]
    hidden = weights @ sub
    logits = out @ hidden
    p_positive = 1 / (1 + math.exp(float(logits[1] - logits[0])))
    alpha = _SIGNS * np.float32(lr * (positive - p_positive))
    grad = alpha @ out
    out += np.outer(alpha, hidden)
    sub += np.outer(weights, grad)
    inp[rows] = sub


def run(inp, out, docs: list, labels: list[bool], epochs: int, lr: float, seed: int, workers: int, on_epoch) -> None:
    """``epochs`` passes over ``docs`` ((rows, weights) each), ``inp`` and ``out`` updated in place;
    ``on_epoch(epoch, examples a pass, examples done, seconds)`` after each (the first process says
    it for all of them)."""
    workers = max(1, min(workers, len(docs) // MIN_PER_WORKER))
    if workers == 1:
        _passes(inp, out, docs, labels, list(range(len(docs))), epochs, lr, random.Random(seed), on_epoch)
        return
    shared = [_shared_copy(m) for m in (inp, out)]
    ids = list(range(len(docs)))
    random.Random(seed).shuffle(ids)
    parent, pids = os.getpid(), []
    for k in range(workers):
        pid = os.fork()
        if pid == 0:  # the child: its share, then out at once (no interpreter teardown of the parent's state)
            code = 1
            try:
                _die_with(parent)
                report = (lambda e, n, done, t: on_epoch(e, n * workers, done * workers, t)) if k == 0 else None
                _passes(*shared, docs, labels, ids[k::workers], epochs, lr, random.Random(seed + 1 + k), report)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise DataPrepError(f"quality model: {len(failed)} of {workers} training processes failed")
    inp[...], out[...] = shared


def _passes(inp, out, docs, labels, ids: list[int], epochs: int, lr: float, rng: random.Random, on_epoch) -> None:
    total, seen, start = epochs * len(ids), 0, time.perf_counter()
    for epoch in range(epochs):
        rng.shuffle(ids)
        for i in ids:
            if len(docs[i][0]):
                step(inp, out, *docs[i], labels[i], lr * (1 - seen / total))
            seen += 1
        if on_epoch:
            on_epoch(epoch, len(ids), seen, time.perf_counter() - start)


def _shared_copy(matrix: np.ndarray) -> np.ndarray:
    """``matrix`` in anonymous shared memory, which forked processes write and the parent sees."""
    buffer = mmap.mmap(-1, max(1, matrix.nbytes))
    shared = np.frombuffer(buffer, dtype=matrix.dtype, count=matrix.size).reshape(matrix.shape)
    shared[...] = matrix
    return shared


def _die_with(parent: int) -> None:
    """A training process ends with the command that forked it (Linux's parent-death signal)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)
