"""Data identity across a resume: what each checkpoint records of every data file, and
what a resume compares. The README promises that a resumed run sees the uninterrupted
run's batches; that holds only if the files behind ``--data`` and ``--eval-data`` still
hold the same data, so a resume checks them (``jaxdist.train.resume``).

A fingerprint is the file's size and a hash of sampled blocks: content only (no path,
mtime or inode), so a copy of the same file on another file system is the same data;
never a full read, so a large corpus costs what a small one does. A change that keeps
the size and falls between the sampled blocks goes unseen: the price of never reading
a corpus whole (a file up to ``BLOCKS x BLOCK`` bytes is read whole, so no change to it
goes unseen).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BLOCK = 64 * 1024  # bytes per sampled block
BLOCKS = 16  # 16 x 64 KiB = 1 MiB read per file, whatever its size (a 1 TiB corpus too)


def file_fingerprint(path) -> dict:
    """``{"size": bytes, "blake2b": 32 hex digits}``: blake2b (16-byte digest) over the
    size and ``BLOCKS`` blocks of ``BLOCK`` bytes at evenly spaced offsets, the first and
    the last block included; a file of at most ``BLOCKS x BLOCK`` bytes is read whole.
    OSError if it cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
        for offset in block_offsets(size):
            f.seek(offset)
            digest.update(f.read(BLOCK))
    return {"size": size, "blake2b": digest.hexdigest()}


def block_offsets(size: int) -> list[int]:
    """Where the sampled blocks start: every block of a small file, else ``BLOCKS``
    evenly spaced from 0 to ``size - BLOCK`` (the last block ends at the end)."""
    if size <= BLOCKS * BLOCK:
        return list(range(0, size, BLOCK))
    last = size - BLOCK
    return [i * last // (BLOCKS - 1) for i in range(BLOCKS)]


def fingerprints(files: dict[str, Path]) -> dict[str, dict]:
    """Role (``train``, ``eval``) -> ``{"path", "size", "blake2b"}`` of each file that can
    be read. One that cannot (removed while the run holds it open) is left out: a
    checkpoint is not failed over its record, and a resume checks only what both have."""
    out = {}
    for role, path in files.items():
        try:
            out[role] = {"path": str(path), **file_fingerprint(path)}
        except OSError:
            continue
    return out


def differences(saved: dict, found: dict) -> list[tuple[str, dict, dict]]:
    """``(role, saved, found)`` for each role both record whose size or hash differs. The
    path is not compared: the same content elsewhere is the same data; a role only one
    of them has (``--eval-data`` added or dropped, a synthetic set) is a flag's change."""
    return [
        (role, saved[role], found[role])
        for role in sorted(saved.keys() & found.keys())
        if _identity(saved[role]) != _identity(found[role])
    ]


def describe(print_: dict) -> str:
    """``8,000 bytes, blake2b 1f0e...`` (in full: the numbers to compare by hand)."""
    return f"{print_.get('size', 0):,} bytes, blake2b {print_.get('blake2b', '?')}"


def _identity(print_: dict) -> tuple:
    return print_.get("size"), print_.get("blake2b")
