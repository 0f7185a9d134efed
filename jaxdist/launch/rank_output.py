"""The ranks' output on the launcher's stdout: bytes, each line prefixed ``[rank R] ``,
less gloo's connection lines.

Nothing is decoded, so no byte can stop the forwarding: a reader that stopped would let
the pipe fill and block its rank for ever.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading

# gloo, jaxlib's CPU collectives, writes "[Gloo] Rank R is connected to N peer ranks.
# Expected number of connected peer ranks is : N" to std::cout for each of its contexts
# (gloo/transport/tcp/context.cc, printConnectivityInfo): always, no setting or log level
# silences it, so it is dropped here. The threads of one process print at once, so a
# line may hold pieces of several such messages (one "[Gloo] Rank " each) with their
# remaining pieces, down to a bare newline, on the next lines. gloo's "is NOT connected
# to: [...]" line, printed when a peer is missing, is kept.
GLOO_START = b"[Gloo] Rank "
GLOO_PIECES = re.compile(
    rb"(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    rb"|Expected number of connected peer ranks is : |\d+)*\r?\n"
)


class GlooLines:
    """Tells gloo's connection lines (and their interleaved remains) in one rank's output."""

    def __init__(self):
        self.unfinished = 0  # messages begun on dropped lines whose newline is still due

    def drop(self, line: bytes) -> bool:
        starts = line.count(GLOO_START)
        if not (starts or self.unfinished) or not GLOO_PIECES.fullmatch(line):
            self.unfinished = 0  # remains come next or not at all: keep later blank lines
            return False
        self.unfinished += starts - 1  # this line's newline ends one message
        return True


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
    line_start, gloo = True, GlooLines()
    with pipe:
        for chunk in iter(lambda: pipe.readline(1 << 16), b""):
            if line_start and gloo.drop(chunk):  # a whole line (it ends with a newline)
                continue
            if line_start and not chunk.startswith(b"[rank"):  # jaxdist.train prefixes its own
                chunk = prefix + chunk
            line_start = chunk.endswith(b"\n")
            out.write(chunk)
    if not line_start:
        out.write(b"\n")
