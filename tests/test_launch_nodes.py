"""``python -m jaxdist.launch --nnodes 2``: two launchers on this machine over loopback,
each playing one machine. They form one group (global ranks, one coordinator, one run
id) that trains as one process with as many devices does; a node that never comes, a
rank that fails on the other node and a node's launcher killed end every node, named.
Also the flags (torchrun's spellings, bad values) and the rendezvous alone, in-process.

Every launcher's processes are killed at teardown (``group_helpers.Launcher``)."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time

import numpy as np
import pytest

from group_helpers import MLP, Launcher, gone_within
from helpers import run_cli
from jaxdist.launch import launcher
from jaxdist.launch.placement import free_port
from jaxdist.launch.rendezvous import Lines, Rendezvous, send


@pytest.fixture
def nodes(tmp_path):
    """``nodes(rank, *args, group=0)``: node ``rank`` of 2's launcher; the nodes of one
    ``group`` share a coordinator port and a rendezvous port. Each logs to its own folder."""
    started, ports = [], {}

    def start(rank: int, *args: str, group: int = 0, env: dict | None = None) -> Launcher:
        folder = tmp_path / f"group{group}-node{rank}"
        folder.mkdir()
        master, rdzv = ports.setdefault(group, (str(free_port()), str(free_port())))
        flags = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        flags += ["--master-port", master, "--rdzv-port", rdzv]
        started.append(Launcher(folder, *flags, *args, env=env))
        return started[-1]

    yield start
    for one in started:
        one.close()


def ended(run: Launcher, seconds: float) -> int:
    return run.proc.wait(timeout=seconds)


SAYS_WHO = (
    "import os; e = os.environ; print('|'.join(e[k] for k in ('JAXDIST_PROCESS_ID', "
    "'JAXDIST_NUM_PROCESSES', 'JAXDIST_COORDINATOR', 'JAXDIST_RUN_ID', "
    "'JAX_NUM_CPU_DEVICES')), flush=True)"
)


def test_two_nodes_are_one_group_of_global_ranks(nodes):
    runs = [nodes(r, "--nproc_per_node", "2", "--cpu-devices-per-proc", "3", "--",
                  sys.executable, "-c", SAYS_WHO, env={"JAXDIST_RUN_ID": f"run-of-node-{r}"})
            for r in (1, 0)]  # fmt: skip
    assert [ended(run, 60) for run in runs] == [0, 0], runs[0].text() + runs[1].text()
    said = {}
    for node, run in zip((1, 0), runs, strict=True):
        for line in run.text().splitlines():
            if line.startswith("[rank "):
                prefix, _, rest = line.partition("] ")
                said[int(prefix[6:])] = (node, *rest.split("|"))
    assert sorted(said) == [0, 1, 2, 3], said
    assert {said[r][:3] for r in (0, 1)} == {(0, "0", "4"), (0, "1", "4")}
    assert {said[r][:3] for r in (2, 3)} == {(1, "2", "4"), (1, "3", "4")}
    assert len({s[3] for s in said.values()}) == 1  # one coordinator
    assert {s[4] for s in said.values()} == {"run-of-node-0"}  # one run directory
    assert {s[5] for s in said.values()} == {"3"}
    assert "all 2 nodes joined: starting ranks 2..3 of 4" in runs[0].text()


TRAIN = ["-m", "jaxdist.train", "--steps", "3", "--log-every", "1", "--global-batch-size",
         "16", *MLP, "--seed", "2", "--optimizer", "sgd", "--lr", "0.3", "--warmup-steps",
         "0", "--clip-norm", "0"]  # fmt: skip


def losses(run_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_train_as_one_process_with_their_devices(tmp_path, nodes):
    """2 nodes x 1 process x 2 devices against 1 process x 4 devices."""
    run_dir, params = tmp_path / "run", tmp_path / "params.npz"
    flags = ["--nproc-per-node", "1", "--cpu-devices-per-proc", "2", "--", sys.executable,
             *TRAIN, "--run-dir", str(run_dir), "--save-params", str(params)]  # fmt: skip
    runs = [nodes(1, *flags), nodes(0, *flags)]
    codes = [ended(run, 120) for run in runs]
    assert codes == [0, 0], runs[0].text()[-3000:] + runs[1].text()[-3000:]
    assert "[rank 0] process 0/2: 2 local of 4 cpu devices" in runs[1].text()
    assert "[rank 1] process 1/2: 2 local of 4 cpu devices" in runs[0].text()
    alone = tmp_path / "alone"
    proc = run_cli(*TRAIN[2:], "--cpu-devices", "4", "--run-dir", str(alone / "run"),
                   "--save-params", str(alone / "params.npz"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(run_dir)) == 3
    np.testing.assert_allclose(losses(run_dir), losses(alone / "run"), rtol=1e-6)
    got, want = np.load(params), np.load(alone / "params.npz")
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)


SLEEP = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]


def test_a_node_that_never_comes_ends_the_others_named(nodes):
    """Node 0 alone, and in another group node 1 alone: each gives up, naming the other."""
    alone0 = nodes(0, "--nproc-per-node", "1", "--init-timeout", "5", "--", *SLEEP)
    alone1 = nodes(1, "--nproc-per-node", "1", "--init-timeout", "3", "--", *SLEEP, group=1)
    start = time.monotonic()
    assert ended(alone0, 60) == 76, alone0.text()
    # it gave up at its --init-timeout (5 s), not the default 300 s; the rest of the bound
    # is the start-up of two launchers on a loaded machine (14 s once, CI shared)
    assert time.monotonic() - start < 60
    assert "node 1 of 2 did not join the rendezvous 127.0.0.1:" in alone0.text()
    assert "within --init-timeout 5s; no process started; exit 76" in alone0.text()
    assert ended(alone1, 60) == 76, alone1.text()
    assert "node 0 is missing: its launcher's rendezvous 127.0.0.1:" in alone1.text()
    assert "[rank" not in alone0.text() + alone1.text()


FAILS_ON_NODE_1 = """import os, pathlib, sys, time
here = pathlib.Path(sys.argv[1])
if os.environ["JAXDIST_PROCESS_ID"] == "0":
    (here / "rank0-up").write_text("")
    time.sleep(60)
deadline = time.monotonic() + 60
while not (here / "rank0-up").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_rank_failing_on_node_1_ends_node_0_with_its_code(tmp_path, nodes):
    job = ["--nproc-per-node", "1", "--", sys.executable, "-c", FAILS_ON_NODE_1, str(tmp_path)]
    node1, node0 = nodes(1, *job), nodes(0, *job)
    node0.wait_for((tmp_path / "rank0-up").exists, 60, "rank 0 up")
    assert ended(node1, 30) == 3, node1.text()
    failed_at = time.monotonic()
    assert ended(node0, 30) == 3, node0.text()
    assert time.monotonic() - failed_at < 5, "node 0 did not end at once"
    said = "first failure in the group: rank 1 on node 1 failed with exit code 3; exit 3"
    for run in (node0, node1):
        assert said in run.text(), run.text()
    assert "rank 1 on node 1 failed with exit code 3: ending this node's" in node0.text()


def test_a_lost_node_ends_the_others(nodes):
    node1 = nodes(1, "--nproc-per-node", "1", "--", *SLEEP)
    node0 = nodes(0, "--nproc-per-node", "1", "--", *SLEEP)
    for run in (node0, node1):
        run.wait_for(lambda run=run: "[rank" in run.text(), 60, "its rank up")
    pids = node0.below()
    node1.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert ended(node0, 30) == 76, node0.text()
    assert time.monotonic() - killed_at < 5
    assert "node 1's launcher is gone" in node0.text()
    assert gone_within(pids, 5)


SAVES_ON_SIGTERM = """import os, pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])


def saved(signum, frame):  # as the trainer: every process stops at one step, saves, exits 75
    (here / "stop").write_text("")
    sys.exit(75)


signal.signal(signal.SIGTERM, saved)
(here / ("up" + os.environ["JAXDIST_PROCESS_ID"])).write_text("")
deadline = time.monotonic() + 60
while not (here / "stop").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(75)
"""


def test_sigterm_to_one_node_stops_every_node_cleanly(tmp_path, nodes):
    """A clean stop (75) is no failure: no node ends another's processes."""
    job = ["--nproc-per-node", "1", "--", sys.executable, "-c", SAVES_ON_SIGTERM, str(tmp_path)]
    node1, node0 = nodes(1, *job), nodes(0, *job)
    up = lambda: all((tmp_path / f"up{r}").exists() for r in (0, 1))  # noqa: E731
    node0.wait_for(up, 60, "both ranks up")
    node1.proc.send_signal(signal.SIGTERM)
    assert [ended(node1, 30), ended(node0, 30)] == [75, 75], node1.text() + node0.text()
    assert "stopped by SIGTERM: every rank saved a checkpoint and exited 75" in node1.text()
    assert "rank 0 on node 0 stopped for preemption (exit 75)" in node0.text()
    assert "fail" not in node0.text() + node1.text()


def parsed(*flags: str):
    args = launcher.parser().parse_args(list(flags))
    return launcher.checked(args, ["true"])


def test_torchruns_spellings():
    torch = parsed("--nnodes", "3", "--node_rank", "2", "--master_addr", "127.0.0.1",
                   "--master_port", "1234", "--nproc_per_node", "4")  # fmt: skip
    ours = parsed("--nnodes", "3", "--node-rank", "2", "--master-addr", "127.0.0.1",
                  "--master-port", "1234", "--nproc-per-node", "4")  # fmt: skip
    assert torch == ours
    place = ours.placement()
    assert (place.first_rank, place.world, place.node) == (8, 12, 2)
    assert (place.coordinator, place.bind, ours.rendezvous) == (
        "127.0.0.1:1234", "127.0.0.1:1234", "127.0.0.1:1235")  # fmt: skip
    assert parsed("--nproc", "2") is None  # one machine: as before


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
         "--node-rank 2 is not in [0, 2) (--nnodes 2)"),
        (["--node-rank", "-1", "--nnodes", "2", "--master-addr", "127.0.0.1"],
         "--node-rank -1 is not in [0, 2)"),
        (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --master-addr"),
        (["--node-rank", "1"], "--node-rank 1 is not in [0, 1) (--nnodes 1)"),
        (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
        (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "70000"],
         "--master-port 70000 is not a port"),
        (["--nnodes", "2", "--master-addr", "127.0.0.1", "--max-restarts", "1"],
         "--max-restarts 1 is for one machine"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_naming_the_values(capsys, flags, says):
    assert launcher.main([*flags, "--nproc-per-node", "1", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: ") and says in err, err


def hello(port: int, node: int, nproc: int = 1) -> Lines:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    send(sock, {"hello": {"node": node, "nnodes": 2, "nproc": nproc, "run_id": f"id{node}"}})
    return Lines(sock)


def test_the_rendezvous_refuses_mismatches_and_starts_with_node_0s_run_id():
    port = free_port()
    service = Rendezvous("127.0.0.1", port, 2, 1, timeout=30)
    try:
        node1 = hello(port, 1)
        assert node1.next() == {"waiting": [0]}
        assert hello(port, 1).next() == {"refused": "node rank 1 has joined already: give "
                                         "each machine its own --node-rank"}  # fmt: skip
        refused = hello(port, 1, nproc=2).next()["refused"]
        assert refused.startswith("--nproc-per-node 2 on node 1, 1 on node 0: every node")
        node0 = hello(port, 0)
        assert node0.next() == node1.next() == {"start": {"run_id": "id0"}}
        send(node1.sock, {"failed": {"text": "rank 1 on node 1 failed", "code": 3}})
        failed = {"failed": {"text": "rank 1 on node 1 failed", "code": 3, "node": 1}}
        assert node0.next() == node1.next() == failed
    finally:
        service.close()


def test_the_rendezvous_names_the_missing_at_its_timeout():
    port = free_port()
    service = Rendezvous("127.0.0.1", port, 2, 1, timeout=0.5)
    try:
        node1 = hello(port, 1)
        assert node1.next() == {"waiting": [0]}
        assert node1.next() == {"missing": [0]}
        assert service.over.wait(1)
    finally:
        service.close()
