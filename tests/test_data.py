"""The input pipeline: sampler semantics, masked evaluation, prefetch, data on the CLI."""

from __future__ import annotations

import queue
import sys
import threading
import time

import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from helpers import metrics_of
from jaxdist.data import Prefetcher, eval_batches, host_batches, loader
from jaxdist.losses import classification_eval, classification_loss
from jaxdist.models.mlp import MLP


def shares(n, g, step, processes, **kw):
    """The global batch of ``step`` as the processes' shares, concatenated in rank order."""
    parts = [
        jaxdist.DistributedSampler(n, g, seed=7, process_index=p, process_count=processes, **kw)
        for p in range(processes)
    ]
    return np.concatenate([s.indices(step) for s in parts])


@pytest.mark.parametrize("last_batch", ["drop", "wrap"])
def test_global_batch_does_not_depend_on_the_process_count(last_batch):
    for step in [0, 1, 14, 15, 16, 47]:
        one = shares(1000, 64, step, 1, last_batch=last_batch)
        for processes in (2, 4, 8):
            np.testing.assert_array_equal(
                shares(1000, 64, step, processes, last_batch=last_batch), one
            )


def test_drop_reads_each_example_at_most_once_per_epoch_and_drops_the_rest():
    sampler = jaxdist.DistributedSampler(1000, 64, seed=7, process_index=0, process_count=1)
    assert sampler.steps_per_epoch == 15  # 15 * 64 = 960; 40 dropped
    epoch0 = np.concatenate([sampler.global_indices(k) for k in range(15)])
    assert len(np.unique(epoch0)) == 960
    epoch1 = np.concatenate([sampler.global_indices(k) for k in range(15, 30)])
    assert len(np.unique(epoch1)) == 960
    assert not np.array_equal(epoch0, epoch1)  # reshuffled by (seed, epoch)


def test_wrap_reads_every_example_exactly_once_per_epoch():
    sampler = jaxdist.DistributedSampler(
        1000, 64, seed=7, last_batch="wrap", process_index=0, process_count=1
    )
    stream = np.concatenate([sampler.global_indices(k) for k in range(125)])  # 8000 = 8 epochs
    for epoch in range(8):
        assert sorted(stream[epoch * 1000 : (epoch + 1) * 1000]) == list(range(1000))
    # step 15 crosses the epoch boundary: 40 rows from epoch 0, 24 from epoch 1
    np.testing.assert_array_equal(sampler.global_indices(15)[:40], sampler.epoch_order(0)[960:])
    np.testing.assert_array_equal(sampler.global_indices(15)[40:], sampler.epoch_order(1)[:24])


def test_restarting_at_step_k_needs_only_k():
    source = {"i": np.arange(500)}

    class Rows:
        def __len__(self):
            return 500

        def __getitem__(self, idx):
            return {"i": source["i"][idx]}

    def sampler():
        return jaxdist.DistributedSampler(500, 32, seed=3, process_index=1, process_count=2)

    straight = host_batches(Rows(), sampler())
    ran = [next(straight)["i"] for _ in range(40)]
    resumed = host_batches(Rows(), sampler(), start_step=23)  # a fresh process at step 23
    for k in range(23, 40):
        np.testing.assert_array_equal(next(resumed)["i"], ran[k])


def test_eval_sampler_counts_every_example_once_across_processes():
    seen, masked = [], 0
    for p in range(2):
        sampler = jaxdist.EvalSampler(1001, 64, process_index=p, process_count=2)
        assert sampler.steps == 16  # ceil(1001 / 64)
        for step in range(sampler.steps):
            idx, mask = sampler.indices(step)
            seen.extend(idx[mask == 1])
            masked += int((mask == 0).sum())
    assert sorted(seen) == list(range(1001))
    assert masked == 16 * 64 - 1001


class Arrays:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, idx):
        return {"x": self.x[idx], "y": self.y[idx]}


@pytest.mark.parametrize("strategy", ["gspmd", "shard_map", "pmap"])
@pytest.mark.parametrize("num_devices", [1, 8])
def test_eval_counts_1001_examples_once_and_matches_the_plain_mean(strategy, num_devices):
    rng = np.random.default_rng(0)
    held_out = Arrays(rng.normal(size=(1001, 6)).astype(np.float32), rng.integers(0, 3, 1001))
    model = MLP(6, 16, 2, 3, rngs=nnx.Rngs(0))
    # Independent reference: the plain mean over all 1001 rows at once, in numpy.
    logits = np.asarray(model(held_out.x), np.float64)  # (1001, 3)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    reference_loss = -log_probs[np.arange(1001), held_out.y]  # (1001,)
    reference_correct = logits.argmax(-1) == held_out.y
    mesh = jaxdist.make_mesh(data=num_devices)
    dp = jaxdist.DataParallel(
        model,
        optax.sgd(0.1),
        classification_loss,
        mesh=mesh,
        strategy=strategy,
        eval_fn=classification_eval,
    )
    state = dp.init_state()
    totals = {}
    for batch in eval_batches(held_out, jaxdist.EvalSampler(1001, 64)):
        for name, value in dp.evaluate(state, jaxdist.shard_batch(batch, mesh)).items():
            totals[name] = totals.get(name, 0.0) + value
    assert totals["count"] == 1001
    np.testing.assert_allclose(totals["loss"] / 1001, reference_loss.mean(), rtol=1e-5)
    assert totals["accuracy"] == reference_correct.sum()


def test_eval_batches_reads_the_first_batches_and_says_so(tmp_path, capsys):
    """``--eval-batches 3``: eval_loss is the numpy mean over the held-out set's first 3
    batches of 64 (192 rows), under the final params, not the whole set's 2048 rows."""
    from jaxdist.data.synthetic import TeacherClassification
    from jaxdist.train.trainer import main

    npz, run_dir = tmp_path / "params.npz", tmp_path / "run"
    args = ["--model", "mlp", "--steps", "2", "--eval-every", "2", "--eval-batch-size", "64"]
    args += ["--eval-batches", "3", "--run-dir", str(run_dir), "--save-params", str(npz)]
    assert main([*args, "--mesh", "data=8"]) == 0
    assert "reads the first 3 of the held-out set's 32 batches of 64" in capsys.readouterr().out
    p = dict(np.load(npz))
    held_out = TeacherClassification(2048, 32, 10, 0, 1)  # the trainer's defaults' set

    def loss(x, y):  # the MLP in float64: gelu (tanh form) layers, then the head
        for i in range(2):
            h = x @ p[f"layers/{i}/kernel"] + p[f"layers/{i}/bias"]
            x = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        logits = (x @ p["head/kernel"] + p["head/bias"]).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return -log_probs[np.arange(len(y)), y].mean()

    record = [r for r in metrics_of(run_dir) if "eval_loss" in r][-1]
    assert record["eval_count"] == 192
    np.testing.assert_allclose(
        record["eval_loss"], loss(held_out.x[:192], held_out.y[:192]), rtol=1e-5
    )
    assert abs(record["eval_loss"] - loss(held_out.x, held_out.y)) > 1e-3  # not the whole set


def blocked_in(thread_id: int, file: str, function: str) -> bool:
    """Whether thread ``thread_id`` is waiting on a lock or condition (its innermost frame
    in threading.py or queue.py) inside ``function`` of ``file``."""
    frame = sys._current_frames().get(thread_id)
    innermost, frames = frame, []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    waiting = innermost is not None and innermost.f_code.co_filename in BLOCKING
    return waiting and (file, function) in frames


BLOCKING = (threading.__file__, queue.__file__)


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Polls ``condition`` until it holds; an AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.005)


def test_prefetcher_keeps_two_batches_ready_and_reports_waits():
    """Counts and order, no latency bound: the producer runs ahead by exactly depth ready
    batches plus one in the making, never further; batches come out in order, as put made
    them; a wait is reported, and is at least as long as the producer was held up."""
    depth, asked = 2, [0]  # asked: the consumer's next() calls so far
    made, progress = [], threading.Condition()

    def put(batch):
        with progress:
            made.append((batch, asked[0]))  # which batch, and how many the consumer took
            progress.notify_all()
        return {"device": batch}

    fetch = Prefetcher(iter(range(50)), put, depth=depth)
    # Before the consumer asks, the producer stops at the full queue, its third batch made
    # (depth ready + one in the making): blocked putting it, it can make no more.
    producer = fetch._thread.ident
    wait_until(lambda: blocked_in(producer, queue.__file__, "put"), 10, "producer at the queue")
    assert [b for b, _ in made] == [0, 1, 2]
    got = []
    for _ in range(50):
        asked[0] += 1
        batch, wait_s = next(fetch)
        got.append(batch)
        assert wait_s >= 0
    assert got == [{"device": i} for i in range(50)]  # in order, what put returned
    with pytest.raises(StopIteration):  # a finite source ends the iteration
        next(fetch)
    assert [b for b, _ in made] == list(range(50))  # each batch made once
    # Batch n is made only once batch n - depth - 1 was taken: the queue holds depth.
    assert all(taken >= n - depth for n, taken in made)
    fetch._thread.join(timeout=5)
    assert not fetch._thread.is_alive()
    fetch.close()

    # A producer held up: the consumer waits, and wait_s covers at least the hold-up.
    hold_s, release, consumer, failed = 0.3, threading.Event(), threading.get_ident(), []

    def held():
        release.wait()
        yield from range(3)

    def release_once_the_consumer_blocks():
        # The consumer's clock starts in Prefetcher.__next__ before it blocks on the queue;
        # the hold-up starts only once it is blocked there.
        try:
            wait_until(lambda: blocked_in(consumer, loader.__file__, "__next__"), 10, "wait")
            time.sleep(hold_s)  # the hold-up itself, which wait_s must cover
        except AssertionError as error:
            failed.append(error)
        release.set()

    slow = Prefetcher(held(), lambda b: b, depth=depth)
    releaser = threading.Thread(target=release_once_the_consumer_blocks, daemon=True)
    releaser.start()
    first, wait_s = next(slow)
    releaser.join(timeout=5)
    assert not failed, f"the consumer never blocked in next(): {failed}"
    assert first == 0 and wait_s >= hold_s
    assert [b for b, _ in slow] == [1, 2]
    slow.close()


def test_prefetcher_raises_the_producers_error_in_the_caller():
    def broken():
        yield 1
        raise OSError("disk gone")

    fetch = Prefetcher(broken(), lambda b: b)
    assert next(fetch)[0] == 1
    with pytest.raises(OSError, match="disk gone"):
        next(fetch)
    fetch._thread.join(timeout=5)
    assert not fetch._thread.is_alive()  # the producer ended with its error
