"""ruff lint and format, as configured in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_lint_and_format_are_clean():
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run(
            [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
