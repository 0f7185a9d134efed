"""Several machines without a scheduler: the same ``python -m jaxdist.launch --nnodes N
--node-rank R --master-addr H --master-port P --nproc-per-node K -- COMMAND`` on each.

Node R's launcher starts global ranks R*K .. R*K+K-1 of N*K, all pointing at the
coordinator H:P that global rank 0 (on node 0) runs. Before that, the launchers meet
at their own rendezvous, which node 0's launcher runs on H at ``--rdzv-port`` (P + 1):
a node that never comes ends every node after ``--init-timeout`` (exit 76, naming it);
once started, the first failure on any node, or a node's launcher lost, ends every
node's processes, and each launcher names it and exits with its code.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from jaxdist.cluster import failures
from jaxdist.cluster.service import resolve
from jaxdist.errors import ConfigError
from jaxdist.launch.exits import Elsewhere, Exit
from jaxdist.launch.placement import Placement, host_port
from jaxdist.launch.rendezvous import Lines, Rendezvous, send

VERDICT_WAIT_S = 2.0  # after our own failure, for node 0's word on which came first (ms)
JOIN_MARGIN_S = 5.0  # past --init-timeout: node 0's word on who is missing comes first
LINGER_S = 2.0  # node 0, after a failure: the others' last words before it closes
RETRY_S = 0.2  # between tries to reach node 0's rendezvous


class NotFormed(Exception):
    """The machines' group did not form, or node 0 refused us; ``code``: the exit code."""

    def __init__(self, message: str, code: int = failures.PEER_DIED):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Nodes:
    nnodes: int
    node: int
    host: str  # --master-addr as given: what the processes connect to
    ip: str  # its address: what the coordinator and the rendezvous listen on
    port: int
    rdzv_port: int
    nproc: int  # per node
    timeout: float

    @property
    def rendezvous(self) -> str:
        return host_port(self.ip, self.rdzv_port)

    def placement(self) -> Placement:
        return Placement(
            self.host,
            self.port,
            host_port(self.ip, self.port),
            first_rank=self.node * self.nproc,
            world=self.nnodes * self.nproc,
            node=self.node,
        )


def checked(args) -> Nodes:
    """The launcher's several-machines flags, or a ConfigError naming the bad value."""
    n, rank = args.nnodes, args.node_rank
    if not 0 <= rank < n:
        raise ConfigError(f"--node-rank {rank} is not in [0, {n}) (--nnodes {n})")
    if not args.master_addr:
        raise ConfigError(f"--nnodes {n} needs --master-addr: node 0's address, on every node")
    rdzv = args.rdzv_port or args.master_port + 1
    for flag, port in (("--master-port", args.master_port), ("--rdzv-port", rdzv)):
        if not 0 < port < 65536:
            raise ConfigError(f"{flag} {port} is not a port (1 .. 65535)")
    if rdzv == args.master_port:
        raise ConfigError(f"--rdzv-port {rdzv} is --master-port: the coordinator's own")
    if args.max_restarts:
        raise ConfigError(f"--max-restarts {args.max_restarts} is for one machine (--nnodes {n})")
    if not args.init_timeout > 0:
        raise ConfigError(f"--init-timeout must be > 0 s, got {args.init_timeout:g}")
    host = args.master_addr.strip("[]")  # an IPv6 address, with or without its brackets
    ip = resolve(host)
    if ip is None:
        raise ConfigError(f"--master-addr {args.master_addr}: no such host")
    return Nodes(n, rank, host, ip, args.master_port, rdzv, args.nproc, args.init_timeout)


def run(nodes: Nodes, out, start) -> int:
    """Joins the other nodes, runs ``start(placement, link)`` (this node's processes, to
    their exit code) and returns this launcher's exit code."""
    server, link = None, Link(nodes, out)
    try:
        if nodes.node == 0:
            server = _serve(nodes)
        run_id = link.join()
        if run_id:  # node 0's: one default run directory for every process
            os.environ["JAXDIST_RUN_ID"] = run_id
        place = nodes.placement()
        last = place.first_rank + nodes.nproc - 1
        ranks = f"ranks {place.first_rank}..{last}" if nodes.nproc > 1 else f"rank {last}"
        out.say(f"all {nodes.nnodes} nodes joined: starting {ranks} of {place.world}")
        code = link.finish(start(place, link))
        return code if server is None else _host_to_the_end(server, code, out)
    except NotFormed as err:
        out.say(f"{'error: ' if err.code == failures.BAD_INPUT else ''}{err}; exit {err.code}")
        return err.code
    finally:
        link.close()
        if server is not None:
            server.close()


def _serve(nodes: Nodes) -> Rendezvous:
    try:
        return Rendezvous(nodes.ip, nodes.rdzv_port, nodes.nnodes, nodes.nproc, nodes.timeout)
    except OSError as err:
        raise NotFormed(
            f"node 0 cannot listen at {nodes.rendezvous} ({err.strerror or err}): --master-addr "
            "is to be this machine's address and --rdzv-port a free port",
            failures.BAD_INPUT,
        ) from None


def _host_to_the_end(server: Rendezvous, code: int, out) -> int:
    """Node 0 runs the rendezvous until every node has ended (not long after a failure)."""
    if not server.over.wait(1.0) and server.first is None:  # said only when it lasts
        with server.lock:
            left = sorted(set(range(server.nnodes)) - set(server.ended))
        nodes = ", ".join(map(str, left))
        out.say(f"waiting for node(s) {nodes} to end: this launcher runs their rendezvous")
    while not server.over.wait(0.2) and server.first is None:
        pass  # short waits: a signal gets through
    server.over.wait(LINGER_S)
    first = server.first
    if code == 0 and first is not None:
        out.say(f"{first['text']} (after this node's processes had finished)")
    return code


class Link:
    """This launcher's connection to the rendezvous, and what it heard there."""

    def __init__(self, nodes: Nodes, out):
        self.nodes, self.out = nodes, out
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.sending = threading.Lock()  # whole lines: the waiting threads and ours send
        self.group = None
        self.told = False  # a failure of ours was sent
        self.verdict: Elsewhere | None = None  # the group's first failure
        self.heard = threading.Event()
        self.closing = False

    def join(self) -> str:
        """Waits for every node; node 0's run id."""
        nodes = self.nodes
        deadline = time.monotonic() + nodes.timeout
        self.sock = self._connect(deadline)
        hello = {"node": nodes.node, "nnodes": nodes.nnodes, "nproc": nodes.nproc}
        send(self.sock, {"hello": {**hello, "run_id": os.environ.get("JAXDIST_RUN_ID", "")}})
        self.out.say(
            f"node {nodes.node} of {nodes.nnodes}: waiting for every node at the rendezvous "
            f"{nodes.rendezvous} (--init-timeout {nodes.timeout:g}s)"
        )
        self.lines, waiting = Lines(self.sock), list(range(nodes.nnodes))
        self.sock.settimeout(RETRY_S)  # short waits: a signal gets through
        while True:
            try:
                message = self.lines.next()
            except TimeoutError:
                if time.monotonic() > deadline + JOIN_MARGIN_S:
                    missing = _nodes(waiting, nodes)
                    raise NotFormed(
                        f"{missing} did not join within --init-timeout {nodes.timeout:g}s"
                    ) from None
                continue
            if message is None:
                raise NotFormed(f"node 0's launcher closed the rendezvous {nodes.rendezvous}")
            if "refused" in message:
                raise NotFormed(f"node 0 refused us: {message['refused']}", failures.BAD_INPUT)
            if "missing" in message:
                missing = _nodes(message["missing"], nodes)
                raise NotFormed(
                    f"{missing} did not join the rendezvous {nodes.rendezvous} within "
                    f"--init-timeout {nodes.timeout:g}s; no process started"
                )
            waiting = message.get("waiting", waiting)
            if "start" in message:
                break
        self.sock.settimeout(None)
        threading.Thread(target=self._listen, daemon=True, name="jaxdist-rdzv-link").start()
        return str(message["start"].get("run_id") or "")

    def _connect(self, deadline: float) -> socket.socket:
        address = (self.nodes.ip, self.nodes.rdzv_port)
        while True:
            try:
                return socket.create_connection(address, timeout=1.0)
            except OSError as err:
                if time.monotonic() > deadline:
                    raise NotFormed(
                        f"node 0 is missing: its launcher's rendezvous {self.nodes.rendezvous} "
                        f"did not answer within --init-timeout {self.nodes.timeout:g}s "
                        f"({err.strerror or err})"
                    ) from None
                time.sleep(RETRY_S)

    def exited(self, done: Exit) -> None:
        """Each of our processes' exits (``group.Group``'s watcher): the first failure
        goes to every node, unless another node's came first."""
        if done.returncode in (0, failures.PREEMPTED):
            return  # a preemption: the processes stop together by themselves
        with self.lock:
            if self.told or self.verdict is not None:
                return
            self.told = True
        self._send({"failed": {"text": str(done), "code": done.code}})

    def attach(self, group) -> None:
        with self.lock:
            self.group, verdict = group, self.verdict
        if verdict is not None and verdict.node != self.nodes.node:
            group.interrupt(verdict)

    def _listen(self) -> None:
        while (message := self.lines.next()) is not None:
            failed = message.get("failed")
            if isinstance(failed, dict):
                text, code, node = failed["text"], int(failed["code"]), int(failed["node"])
                self._heard(Elsewhere(text, code, node))
        if not self.closing:
            where = f"the rendezvous {self.nodes.rendezvous} closed"
            self._heard(Elsewhere(f"node 0's launcher is gone: {where}", failures.PEER_DIED, 0))

    def _heard(self, verdict: Elsewhere) -> None:
        with self.lock:
            if self.verdict is not None:
                return
            self.verdict, group = verdict, self.group
        self.heard.set()
        if group is not None and verdict.node != self.nodes.node:
            group.interrupt(verdict)

    def finish(self, code: int) -> int:
        """Tells node 0 how this node's processes ended; the launcher's exit code."""
        if self.told:
            self.heard.wait(VERDICT_WAIT_S)
        self._send({"done": code})
        verdict = self.verdict
        if code == 0 or verdict is None:
            return code
        if verdict.node == self.nodes.node and verdict.code != code:
            return code  # ours, an echo of why we ended (Ctrl-C: 130)
        self.out.say(f"first failure in the group: {verdict}; exit {verdict.code}")
        return verdict.code

    def _send(self, message: dict) -> None:
        with self.sending:
            send(self.sock, message)

    def close(self) -> None:
        self.closing = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


def _nodes(ranks: list[int], nodes: Nodes) -> str:
    named = ", ".join(map(str, ranks))
    return f"node{'s' if len(ranks) > 1 else ''} {named} of {nodes.nnodes}"
