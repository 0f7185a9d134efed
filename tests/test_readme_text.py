"""What README.md and docs/*.md name exists: paths, modules, links and anchors; the
CLI reference (docs/cli.md) lists exactly the trainer's flags; the README opens with the
two set-up commands (the blocks themselves run in tests/test_readme_commands.py)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from jaxdist.checkpoint.lock import LOCK  # the run directory's lock file, not a module
from readme_blocks import PROSE, ROOT, shell_commands


def test_the_readme_opens_with_the_two_commands():
    first = [c.code for c in shell_commands([ROOT / "README.md"])[:2]]
    assert first == [
        "pip install -e . && python -m jaxdist.train --cpu-devices 8",
        'pip install -e ".[test]" && python -m jaxdist.plan --install-gpu-compiler && pytest',
    ]


# --- what the pages name exists


def prose(page: Path) -> str:
    return page.read_text()


def test_named_paths_exist():
    missing = []
    pattern = re.compile(r"(?<![\w/.~-])((?:jaxdist|tests|experiments|slurm|docs)/[\w./*-]*[\w*])")
    for page in PROSE:
        text = prose(page)
        names = set(pattern.findall(text))
        if page.parent.name == "tests":  # tests/README.md names its files without tests/
            names |= {f"tests/{n}" for n in re.findall(r"(?<![\w/])(test_[\w*]+\.py)", text)}
        for name in names:
            if not list(ROOT.glob(name.rstrip("/"))):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "\n".join(sorted(missing))


def test_named_modules_exist():
    missing = []
    for page in PROSE:
        text = prose(page)
        for module in set(re.findall(r"python -m (jaxdist[\w.]*)", text)):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
        for dotted in set(re.findall(r"`(jaxdist(?:\.\w+)+)", text)) - {LOCK}:
            if not resolves(dotted):
                missing.append(f"{page.relative_to(ROOT)}: {dotted}")
    assert not missing, "\n".join(sorted(missing))


def resolves(dotted: str) -> bool:
    """``jaxdist.a.b.name``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings (outside fences)."""
    found, in_fence = set(), False
    for text in page.read_text().splitlines():
        if text.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and text.startswith("#"):
            title = text.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_links_and_anchors_resolve():
    broken = []
    for page in PROSE:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_cli_reference_lists_every_flag():
    from jaxdist.train import config as config_lib

    page = (ROOT / "docs" / "cli.md").read_text()
    table = page[page.index("| flag | default | meaning |") :].split("\n\n", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:
        listed |= set(re.findall(r"`(--[\w-]+)", row.split("|")[1]))
    parser = config_lib.build_parser()
    flags = {f for f in parser._option_string_actions if f.startswith("--") and "." not in f}
    flags -= {"--help"}
    negated = {f for f in flags if f.startswith("--no-") and f"--{f[5:]}" in flags}
    assert listed - flags == set(), "listed, but not a flag"
    assert flags - negated - listed == set(), "a flag the CLI reference does not list"
