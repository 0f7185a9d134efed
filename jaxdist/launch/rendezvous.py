"""The launchers' own rendezvous: a small service node 0's launcher runs while its group
of several machines lives, so that each node's launcher learns about the others.

JSON lines over TCP, one connection per node's launcher, node 0's own included:

* node -> service: ``{"hello": {"node", "nnodes", "nproc", "run_id"}}`` first, then at
  most ``{"failed": {"text", "code"}}`` (one of its processes failed) and
  ``{"done": code}`` (its processes ended) before it closes.
* service -> node: ``{"waiting": [node, ...]}`` as nodes arrive, then ``{"start":
  {"run_id"}}`` once every node has (node 0's run id: one run directory name), or
  ``{"missing": [...]}`` at ``--init-timeout``, or ``{"refused": text}`` (flags that do
  not match node 0's); after the start, ``{"failed": {"text", "code", "node"}}``, the
  first failure anywhere, to every node. A node whose connection closes before its
  ``done`` is lost: that is a failure too, exit 76.

No authentication: it listens on the one address given, never every interface.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading

from jaxdist.cluster import failures
from jaxdist.launch.placement import host_port

MAX_LINE = 1 << 16  # bytes; a longer line is not one of ours: the connection is dropped


def send(sock: socket.socket, message: dict) -> bool:
    """False when the peer is gone."""
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


class Lines:
    """JSON messages off a socket, one a line; ``None`` once it closes or breaks."""

    def __init__(self, sock: socket.socket):
        self.sock, self.held = sock, b""

    def next(self) -> dict | None:
        """The next message; ``TimeoutError`` (with a socket timeout) leaves the rest
        for the next call."""
        while b"\n" not in self.held:
            if len(self.held) > MAX_LINE:
                return None
            try:
                chunk = self.sock.recv(4096)
            except TimeoutError:
                raise
            except OSError:
                return None
            if not chunk:
                return None
            self.held += chunk
        line, self.held = self.held.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


class Rendezvous:
    """The service, on ``(ip, port)``, for ``nnodes`` launchers of ``nproc`` processes."""

    def __init__(self, ip: str, port: int, nnodes: int, nproc: int, timeout: float):
        self.nnodes, self.nproc, self.timeout = nnodes, nproc, timeout
        self.address = host_port(ip, port)
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self.server = socket.create_server((ip, port), family=family, backlog=nnodes)
        self.lock = threading.Lock()
        self.nodes: dict[int, socket.socket] = {}  # node rank -> its connection
        self.ended: dict[int, int] = {}  # node rank -> its code (lost: 76)
        self.first: dict | None = None  # the first failure anywhere
        self.started = False
        self.run_id = ""  # node 0's
        self.over = threading.Event()  # every node ended, or the group never formed
        self.missed = threading.Timer(timeout, self._time_up)
        self.missed.daemon = True
        self.missed.start()
        threading.Thread(target=self._accept, daemon=True, name="jaxdist-rdzv").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lines = Lines(conn)
        node = self._register(conn, lines.next())
        if node is None:
            conn.close()
            return
        while (message := lines.next()) is not None:
            if "failed" in message:
                failed = message["failed"]
                self._failed(str(failed.get("text")), int(failed.get("code", 1)), node)
            elif "done" in message:
                with self.lock:
                    self.ended.setdefault(node, int(message["done"]))
                    self._check_over()
        self._closed(node)

    def _register(self, conn: socket.socket, hello: dict | None) -> int | None:
        said = (hello or {}).get("hello")
        if not isinstance(said, dict):
            return None
        node = said.get("node")
        if not isinstance(node, int):
            return None
        with self.lock:
            problem = self._refusal(node, said)
            if problem:
                send(conn, {"refused": problem})
                return None
            self.nodes[node] = conn
            missing = sorted(set(range(self.nnodes)) - set(self.nodes))
            if node == 0:
                self.run_id = said.get("run_id", "")
            if missing:
                for each in self.nodes.values():
                    send(each, {"waiting": missing})
            else:
                self.started = True
                self.missed.cancel()
                for each in self.nodes.values():
                    send(each, {"start": {"run_id": self.run_id}})
        return node

    def _refusal(self, node: int, said: dict) -> str:
        nnodes, nproc = said.get("nnodes"), said.get("nproc")
        if not 0 <= node < self.nnodes:
            return f"--node-rank {node} is not in [0, {self.nnodes})"
        if nnodes != self.nnodes:
            return f"--nnodes {nnodes} on node {node}, {self.nnodes} on node 0"
        if nproc != self.nproc:
            return (
                f"--nproc-per-node {nproc} on node {node}, {self.nproc} on node 0: every node "
                "starts as many processes"
            )
        if node in self.nodes:
            return f"node rank {node} has joined already: give each machine its own --node-rank"
        if self.started or self.over.is_set():
            return f"node {node} came too late: the group has started or given up"
        return ""

    def _failed(self, text: str, code: int, node: int) -> None:
        with self.lock:
            if self.first is not None:
                return
            self.first = {"text": text, "code": code, "node": node}
            for each in self.nodes.values():
                send(each, {"failed": self.first})

    def _closed(self, node: int) -> None:
        with self.lock:
            if not self.started:  # left before the start: it may come again
                self.nodes.pop(node, None)
                return
            lost = node not in self.ended
            self.ended.setdefault(node, failures.PEER_DIED)
        if lost:
            text = f"node {node}'s launcher is gone: its connection to the rendezvous closed"
            self._failed(text, failures.PEER_DIED, node)
        with self.lock:
            self._check_over()

    def _check_over(self) -> None:
        if self.started and len(self.ended) == self.nnodes:
            self.over.set()

    def _time_up(self) -> None:
        with self.lock:
            if self.started:
                return
            missing = sorted(set(range(self.nnodes)) - set(self.nodes))
            for each in self.nodes.values():
                send(each, {"missing": missing})
            self.over.set()

    def close(self) -> None:
        self.missed.cancel()
        with contextlib.suppress(OSError):
            self.server.close()
        with self.lock:
            for conn in self.nodes.values():
                with contextlib.suppress(OSError):
                    conn.close()
