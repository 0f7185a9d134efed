"""The full tier's list (tests/full_tier.txt), read for conftest.py and test_tiers.py; CI's
record of the tests its first run passed; the XLA flags the suite compiles with."""

from __future__ import annotations

import re
from pathlib import Path

LIST = Path(__file__).with_name("full_tier.txt")


def full_tier(path: Path = LIST) -> dict[str, float]:
    """Entry (``file``, ``file::test`` or ``file::test[case]``) -> its measured seconds."""
    entries = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            seconds, entry = line.split(maxsplit=1)
            entries[entry.strip()] = float(seconds)
    return entries


def in_list(nodeid: str, entries) -> bool:
    """Whether a test (``tests/test_x.py::test_y[case]``, maybe with xdist's ``@group``)
    is listed: its file, its function or itself."""
    test = bare(nodeid.removeprefix("tests/"))
    file = test.split("::")[0]
    function = test.split("[")[0]
    return file in entries or function in entries or test in entries


# CI runs the quick tier first (the README's test command, with the test extra only), then
# the full tier with every extra: the second run leaves out what the first one passed
# (``--record-passed=FILE`` there, ``--skip-passed=FILE`` here), so that no test runs
# twice; a test the first run skipped (its extra missing) or failed runs again.


def read_passed(path: Path) -> set[str]:
    """The node ids (without xdist's ``@group``) a ``--record-passed`` run wrote."""
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def bare(nodeid: str) -> str:
    """A node id without xdist's ``@group`` suffix."""
    return re.sub(r"@\w+$", "", nodeid)


class PassedRecord:
    """A pytest plugin: the passed tests' node ids, written to ``path`` at the end."""

    def __init__(self, path: Path):
        self.path, self.passed = path, set()

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" and report.passed:
            self.passed.add(bare(report.nodeid))

    def pytest_sessionfinish(self) -> None:
        self.path.write_text("".join(f"{nodeid}\n" for nodeid in sorted(self.passed)))


def fast_compile_flags(always: str, *optional: str) -> str:
    """``always`` and each ``optional`` XLA flag that this jaxlib's XLA accepts, tried in a
    child process (XLA ends a process whose XLA_FLAGS hold a flag it does not know)."""
    import os
    import subprocess
    import sys

    kept = [always]
    for flag in optional:
        env = {**os.environ, "XLA_FLAGS": f"{always} {flag}", "JAX_PLATFORMS": "cpu"}
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        if subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0:
            kept.append(flag)
    return " ".join(kept)
