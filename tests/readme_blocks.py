"""The README's and docs' fenced shell blocks, read into commands (for
tests/test_readme_commands.py and tests/test_readme_text.py): which lines run, which
are marked, the flags each trainer line gets, the files a page shows."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROSE = [*PAGES, ROOT / "tests" / "README.md"]  # pages whose paths and links are checked
LINKED = ("README.md", "docs", "experiments", "slurm")  # what commands read from the root
SHELL = ("bash", "sh", "console")
RUNNABLE = {"python", "ls", "cat", "head", "tail"}  # programs that run here as printed
MARK = re.compile(
    r"#\s*(?:(?P<skip>needs:.*|server\b.*)|exits\s+(?P<code>\d+)|extra:\s*(?P<extra>\w+))$"
)
# "# extra: NAME": the line needs the optional extra NAME of pyproject.toml; it runs where
# the extra's package imports (CI's full tier installs every extra) and the block is
# skipped, saying which install it needs, where it does not (the README's own install)
EXTRAS = {
    "grain": "grain",
    "wandb": "wandb",
    "hf": "transformers",
    "text": "tokenizers",
    "eval": "lm_eval",
}
FILE_FENCE = re.compile(r"#\s+([\w.-]+\.(?:py|yaml|yml|json|txt))$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|"}
TRAIN = ["python", "-m", "jaxdist.train"]
STEPS = 2
EVAL_TOKENS = 8192  # the stdlib corpus's held-out split, cut to this for the test
TIMEOUT_S = 300
MAX_SKIPPED = 24  # marked today: pip, pytest (the quick tier; the full tier with every
# extra), sbatch, a GPU, a cluster, tensorboard, data, the 20-minute layout x feature
# matrix (tests/test_matrix.py runs its covering subset), the GPU compiler's download,
# the minute-long 100B plan, mpirun (tests/test_mpirun.py runs it where Open MPI is
# installed), two machines, Kubernetes, and GPT-2 from the Hugging Face Hub
# (tests/test_hf_gpt2.py runs its flow on a GPT-2 built locally)


@dataclasses.dataclass
class Fence:
    page: Path
    line: int  # of the opening ```
    lang: str
    lines: list[tuple[int, str]]  # (line number, text)


@dataclasses.dataclass
class Command:
    page: Path
    line: int
    code: str  # the command, without its trailing comment
    skip: bool  # "# needs: ..." or "# server"
    expect: int | None  # "# exits N": N, and run as printed
    output: list[str] = dataclasses.field(default_factory=list)  # console: lines it prints
    extra: str | None = None  # "# extra: NAME": runs where that extra is installed

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def tokens(self) -> list[str]:
        return shlex.split(self.code)

    def segments(self) -> list[list[str]]:
        """The simple commands of the line, each without its leading VAR=value words."""
        out, current = [], []
        for token in [*self.tokens, ";"]:
            if token in SEPARATORS:
                while current and ENV_ASSIGNMENT.match(current[0]):
                    current.pop(0)
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
        return out

    @property
    def runnable(self) -> bool:
        return all(segment[0] in RUNNABLE for segment in self.segments())


def fences(page: Path) -> list[Fence]:
    found, fence = [], None
    for n, text in enumerate(page.read_text().splitlines(), 1):
        if fence is None:
            opening = re.match(r"^\s*```(\w*)\s*$", text)
            if opening:
                fence = Fence(page, n, opening.group(1), [])
        elif text.strip().startswith("```"):
            found.append(fence)
            fence = None
        else:
            fence.lines.append((n, text))
    return found


def split_comment(text: str) -> tuple[str, str]:
    """(code, comment): the comment from the first ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i:].strip()
    return text.rstrip(), ""


def commands_of(fence: Fence) -> list[Command]:
    commands: list[Command] = []
    start, held = None, ""
    for n, text in fence.lines:
        if fence.lang == "console":
            if not text.startswith("$ "):
                if commands and text.strip():
                    commands[-1].output.append(text.strip())
                continue
            text = text[2:]
        if start is None:
            start = n
        held += text.strip()
        if held.endswith("\\"):  # continued on the next line
            held = held[:-1] + " "
            continue
        code, comment = split_comment(held)
        first, start, held = start, None, ""
        if not code:
            continue
        mark = MARK.match(comment) if comment else None
        skip = bool(mark and mark.group("skip"))
        expect = int(mark.group("code")) if mark and mark.group("code") else None
        extra = mark.group("extra") if mark else None
        commands.append(Command(fence.page, first, code, skip, expect, extra=extra))
    return commands


def shell_commands(pages=PAGES) -> list[Command]:
    return [
        command
        for page in pages
        for fence in fences(page)
        if fence.lang in SHELL
        for command in commands_of(fence)
    ]


def page_files(page: Path) -> dict[str, str]:
    """The files a page shows in full: a fence whose first line is ``# name.ext``."""
    files = {}
    for fence in fences(page):
        if fence.lang in SHELL or not fence.lines:
            continue
        named = FILE_FENCE.match(fence.lines[0][1].strip())
        if named:
            files[named.group(1)] = "\n".join(text for _, text in fence.lines) + "\n"
    return files


def flag(tokens: list[str], name: str) -> str | None:
    """The last value given to ``name`` (``--name value`` or ``--name=value``)."""
    value = None
    for i, token in enumerate(tokens):
        if token == name and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif token.startswith(name + "="):
            value = token.split("=", 1)[1]
    return value


def train_args(tokens: list[str]) -> list[list[str]]:
    """The arguments of each ``python -m jaxdist.train`` in ``tokens``, and of the trainer
    behind ``sbatch script.sh ARGS`` (what follows the script goes to the trainer)."""
    found = []
    for i in range(len(tokens)):
        if tokens[i : i + 3] == TRAIN:
            rest = tokens[i + 3 :]
        elif tokens[i] == "sbatch":
            script = next(j for j in range(i, len(tokens)) if tokens[j].endswith(".sh"))
            assert (ROOT / tokens[script]).is_file(), f"no script {tokens[script]}"
            rest = tokens[script + 1 :]
        else:
            continue
        end = next((j for j, t in enumerate(rest) if t in SEPARATORS), len(rest))
        found.append(rest[:end])
    return found


def steps_for(tokens: list[str], runs_seen: dict[str, int]) -> int:
    profile = flag(tokens, "--profile")
    if profile:
        return int(profile.split(":")[1])
    run_dir = flag(tokens, "--run-dir")
    return STEPS * (runs_seen.get(run_dir, 0) + 1)


# --- the blocks, run


def blocks() -> list:
    cases = []
    for page in PAGES:
        for fence in fences(page):
            commands = commands_of(fence) if fence.lang in SHELL else []
            if any(not c.skip for c in commands):
                where = f"{page.relative_to(ROOT)}:{fence.line}"
                cases.append(pytest.param(commands, id=where))
    return cases
