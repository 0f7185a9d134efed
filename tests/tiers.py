"""The full tier's list (tests/full_tier.txt), read for conftest.py and test_tiers.py."""

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
    test = re.sub(r"@\w+$", "", nodeid.removeprefix("tests/"))
    file = test.split("::")[0]
    function = test.split("[")[0]
    return file in entries or function in entries or test in entries
