"""grain sources and ``--data-workers`` (``jaxdist/data/grain_source.py``): a grain
``MapDataset`` with a ``.map`` transform and a random-access source give the batches of
a plain numpy reader of the sampler's indices, in training too (the same params and eval
loss, bit for bit); grain's worker processes give the same batches in the same order,
from a resume step and for either of two processes' rows, whatever signal the terminal
sends them; the refusals; a worker that dies ends the iteration with an error naming
it; no worker outlives its run, nor a killed trainer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

grain = pytest.importorskip("grain", reason="grain is optional: pip install 'jaxdist[grain]'")
import psutil  # noqa: E402 - grain's own dependency (through portpicker)

import jaxdist  # noqa: E402
from helpers import next_within  # noqa: E402
from jaxdist.data import host_batches  # noqa: E402
from jaxdist.errors import ConfigError, JaxdistError  # noqa: E402
from jaxdist.train import build_data  # noqa: E402
from jaxdist.train.config import parse_args  # noqa: E402
from jaxdist.train.trainer import train  # noqa: E402

EXAMPLES, FEATURES, CLASSES, HELD_OUT = 96, 12, 5, 40
RAW = np.random.default_rng(7).normal(size=(EXAMPLES, FEATURES)).astype(np.float32)


# --- the data: raw records, a per-example transform, and its numpy reference
class Records(grain.sources.RandomAccessDataSource):
    """Raw records by index: grain's random-access protocol, declared."""

    def __len__(self):
        return EXAMPLES

    def __getitem__(self, index):
        return {"raw": RAW[index], "id": index}


def transform(record):
    """The per-example work grain runs: numpy on one record."""
    return {"x": np.tanh(2.0 * record["raw"]), "y": np.int32(record["id"] % CLASSES)}


class Transformed(grain.sources.RandomAccessDataSource):
    """A random-access source of finished examples (the first ``n``)."""

    def __init__(self, n=HELD_OUT):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return transform(Records()[index])


def mapped():
    return grain.MapDataset.source(Records()).map(transform)


def reference(indices):
    """The batch of ``indices``, vectorised numpy: what every pipeline must give."""
    indices = np.asarray(indices)
    return {"x": np.tanh(2.0 * RAW[indices]), "y": (indices % CLASSES).astype(np.int32)}


class NumpyRows:
    """The same examples as a plain jaxdist DataSource."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, indices):
        return reference(indices)


# --- factories for --data test_grain:NAME
def grain_data(split):
    return mapped() if split == "train" else Transformed()


def numpy_data(split):
    return NumpyRows(EXAMPLES if split == "train" else HELD_OUT)


def tuples():
    return grain.MapDataset.source(Records()).map(lambda r: (r["raw"], r["id"]))


def endless():
    return mapped().repeat()


def filtered():
    return mapped().filter(lambda e: e["y"] != 0)


def bare():
    return mapped().map(lambda e: e["x"])


def ragged():
    return mapped().map(lambda e: {"x": e["x"][: 4 + int(e["y"])], "y": e["y"]})


def iterable():
    return mapped().to_iter_dataset()


def sampler(process=0, processes=1):
    return jaxdist.DistributedSampler(
        EXAMPLES, 16, seed=3, process_index=process, process_count=processes
    )


def assert_batches(got, indices_of_steps):
    for batch, indices in zip(got, indices_of_steps, strict=True):
        want = reference(indices)
        assert batch.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(batch[name], want[name])
            assert batch[name].dtype == want[name].dtype, name


def take(batches, n):
    return [next(batches) for _ in range(n)]


def workers_of_this_process():
    """grain's worker processes (multiprocessing's spawn children), not its tracker."""
    children = psutil.Process().children(recursive=True)
    return [p for p in children if "spawn_main" in " ".join(_cmdline(p))]


def _cmdline(process):
    try:
        return process.cmdline()
    except psutil.Error:
        return []


# --- tests
def test_grain_sources_give_the_transform_of_the_samplers_indices():
    one = sampler()
    for source in (mapped(), Transformed(EXAMPLES)):  # a MapDataset, a random-access one
        assert_batches(take(host_batches(source, one), 8), [one.indices(s) for s in range(8)])
    # two processes' rows side by side are one process's; a resume at step 5 needs only 5
    halves = [take(host_batches(mapped(), sampler(p, 2)), 6) for p in (0, 1)]
    joined = [np.concatenate([a["x"], b["x"]]) for a, b in zip(*halves, strict=True)]
    assert np.array_equal(joined, [reference(one.indices(s))["x"] for s in range(6)])
    resumed = take(host_batches(mapped(), one, start_step=5), 3)
    assert_batches(resumed, [one.indices(5 + s) for s in range(3)])
    (tokens,) = take(host_batches(bare(), one), 1)  # one array per element: an lm's ids
    assert tokens.keys() == {"tokens"}
    np.testing.assert_array_equal(tokens["tokens"], reference(one.indices(0))["x"])


def test_workers_give_the_same_batches_in_order_and_survive_terminal_signals():
    one, second = sampler(), sampler(1, 2)
    batches = host_batches(mapped(), one, workers=2)
    first = take(batches, 3)
    workers = workers_of_this_process()
    assert len(workers) == 2
    for worker in workers:  # Ctrl-C or a scheduler's SIGTERM reach the group: the
        worker.send_signal(signal.SIGINT)  # trainer decides, the workers go on
        worker.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert_batches(first + take(batches, 5), [one.indices(s) for s in range(8)])
    batches.close()
    assert not workers_of_this_process()
    # process 1 of 2 resuming at step 4: the rows its serial reader gives
    resumed = host_batches(mapped(), second, start_step=4, workers=2)
    assert_batches(take(resumed, 4), [second.indices(4 + s) for s in range(4)])
    resumed.close()
    assert not workers_of_this_process()


def train_on(data, *flags):
    args = ["--model", "mlp", "--in-features", str(FEATURES), "--num-classes", str(CLASSES)]
    args += ["--hidden", "16", "--num-devices", "2", "--steps", "4", "--log-every", "1"]
    args += ["--global-batch-size", "16", "--eval-every", "4", "--data", data, *flags]
    run = train(parse_args(args), write=False, quiet=True)
    losses = [(r.get("loss"), r.get("eval_loss")) for r in run.history]
    return losses, run.dp.host_params(run.state)


def test_training_on_grain_equals_training_on_numpy_with_and_without_workers():
    want_losses, want_params = train_on("test_grain:numpy_data")
    assert any(eval_loss is not None for _, eval_loss in want_losses)
    for workers in ("0", "2"):
        losses, params = train_on("test_grain:grain_data", "--data-workers", workers)
        assert losses == want_losses, workers
        for name in want_params:
            np.testing.assert_array_equal(params[name], want_params[name], err_msg=name)
        assert not workers_of_this_process(), "a data worker outlived its run"


@pytest.mark.parametrize(
    "data, flags, words",
    [
        ("synthetic", ["--data-workers", "2"], ["--data-workers 2", "grain", "Classification"]),
        ("test_grain:numpy_data", ["--data-workers", "1"], ["NumpyRows", "--data-workers 0"]),
        ("test_grain:tuples", [], ["element 0 is a tuple", "dict of numpy arrays"]),
        ("test_grain:endless", [], ["endless", ".repeat()"]),
        ("test_grain:filtered", [], ["is a NoneType", ".filter()"]),
        ("test_grain:bare", [], ["one array", "task is classify"]),
        ("test_grain:ragged", [], ["'x' has the shapes", "(4,)", "(5,)"]),
        ("test_grain:iterable", [], ["IterDataset has no random access", "MapDataset"]),
    ],
)
def test_refusals_name_what_was_found(data, flags, words):
    config = parse_args(["--model", "mlp", "--in-features", str(FEATURES), "--data", data, *flags])
    with pytest.raises(ConfigError) as raised:
        build_data.build(config, "classify", progress=False)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_a_dying_worker_or_a_raising_transform_ends_the_iteration():
    one = sampler()
    doomed = int(one.indices(2)[0])  # its worker exits with code 3 building step 3

    def crash(record):
        if record["id"] == doomed:
            os._exit(3)
        return transform(record)

    raw = grain.MapDataset.source(Records())
    batches = host_batches(raw.map(crash), one, workers=1)
    got, error = next_within(batches)
    assert_batches([got], [one.indices(0)])
    while error is None:
        _, error = next_within(batches)
    assert isinstance(error, JaxdistError), repr(error)
    assert "a --data-workers process died" in str(error) and "exit code 3" in str(error)
    batches.close()

    def refuse(record):
        raise ValueError(f"bad example {record['id']}")

    serial, parallel = (host_batches(raw.map(refuse), one, workers=n) for n in (0, 1))
    _, error = next_within(parallel)
    with pytest.raises(ValueError) as raised:
        next(serial)
    assert type(error) is ValueError and str(error) == str(raised.value)
    parallel.close()
    assert not workers_of_this_process()


KILLED = """
import os, signal, sys, numpy as np, grain, psutil
from jaxdist.data import DistributedSampler, host_batches

if __name__ == "__main__":
    rows = grain.MapDataset.range(64).map(lambda i: {"x": np.full(3, i, np.float32)})
    sampler = DistributedSampler(64, 8, process_index=0, process_count=1)
    batches = host_batches(rows, sampler, workers=2)
    next(batches)
    kids = psutil.Process().children()
    pids = [str(p.pid) for p in kids if "spawn_main" in " ".join(p.cmdline())]
    open(sys.argv[1], "w").write(" ".join(pids))
    os.kill(os.getpid(), signal.SIGKILL)  # nothing closes the workers
"""


def test_workers_of_a_killed_trainer_exit(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out, pid_file = tmp_path / "out.txt", tmp_path / "pids.txt"
    with out.open("w") as sink:  # not a pipe: a worker left alive would hold it open
        run = [sys.executable, str(script), str(pid_file)]
        proc = subprocess.run(run, stdout=sink, stderr=sink, env=env)
    assert proc.returncode == -signal.SIGKILL, out.read_text()
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 2, out.read_text()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _running(pid)]
        time.sleep(0.1)
    for pid in alive:  # they ignore SIGTERM
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their killed parent"


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_jaxdist_imports_grain_only_when_a_grain_object_comes():
    check = "import sys, jaxdist.data, jaxdist.train.build_data; assert 'grain' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
