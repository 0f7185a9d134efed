"""The ranks' output on the launcher's stdout: bytes, each line prefixed ``[rank R] ``.

Nothing is decoded, so no byte can stop the forwarding: a reader that stopped would let
the pipe fill and block its rank for ever.
"""

from __future__ import annotations

import contextlib
import sys
import threading


class Output:
    """Bytes to a text stream (default ``sys.stdout``), a whole line at a time. Never
    raises: a forwarding thread that died would leave its rank blocked on a full pipe."""

    def __init__(self, name: str, stream=None):
        self.name = name  # our own lines: "[launch] ..." or "[spawn] ..."
        self.stream = sys.stdout if stream is None else stream
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock, contextlib.suppress(Exception):
            buffer = getattr(self.stream, "buffer", None)
            if buffer is None:  # a text-only stream, e.g. a notebook's
                self.stream.write(data.decode(errors="replace"))
            else:
                self.stream.flush()  # text written before goes first
                buffer.write(data)
                buffer.flush()
            self.stream.flush()

    def say(self, text: str) -> None:
        self.write(f"[{self.name}] {text}\n".encode())


def forward(rank: int, pipe, out: Output) -> None:
    prefix = f"[rank {rank}] ".encode()
    line_start = True
    with pipe:
        for chunk in iter(lambda: pipe.readline(1 << 16), b""):
            if line_start and not chunk.startswith(b"[rank"):  # jaxdist.train prefixes its own
                chunk = prefix + chunk
            line_start = chunk.endswith(b"\n")
            out.write(chunk)
    if not line_start:
        out.write(b"\n")
