"""Every command that README.md and docs/*.md print runs, as printed.

The fenced shell blocks (```bash, ```sh, ```console) of the pages are read here, one test
case per block, named by page and line (``README.md:63``). A block's commands run in
order with bash, in a fresh directory that links the repository's README.md, docs/,
experiments/ and slurm/ (the commands are written for the repository's root) and holds the
files the same page shows in a fence whose first line names them (``# my_data.py``).

- Each ``python -m jaxdist.train`` gets ``--steps 2 --log-every 1`` appended (argparse:
  the last value wins): 4 when an earlier command of the block used the same --run-dir,
  so that this one resumes; STOP for ``--profile START:STOP``.
- A trailing ``# needs: ...`` or ``# server`` skips the line; the skipped lines are
  counted, and the trainer flags on them are still parsed by the real parser. A line that
  is neither runnable nor marked fails.
- ``# extra: NAME``: the line needs the optional extra NAME (``pip install -e '.[NAME]'``);
  where its package is missing (the README's own install) the block is skipped, saying so.
- A skipped line that later lines depend on has a stand-in (``readme_stand_ins.py``): a
  download from the Hugging Face Hub (``hf download ORG/NAME --local-dir DIR``) becomes a
  tiny random model of NAME's family and its tokenizer, saved in DIR by transformers'
  ``save_pretrained``; the block is skipped where transformers or tokenizers is missing.
- ``# exits N``: the line runs exactly as printed and must exit N. In a ```console block,
  the lines after a ``$ `` command are output it must print.
- What the pages say a command writes must be there (the run directory's files, the token
  files, the report).

Beside the blocks: the paths, modules, links and anchors the pages name exist, the CLI
reference lists exactly the trainer's flags, and the README opens with the two set-up
commands. tests/README.md says more.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import failures_of, metrics_of
from readme_blocks import (
    EVAL_TOKENS,
    EXTRAS,
    LINKED,
    MAX_SKIPPED,
    ROOT,
    SEPARATORS,
    TIMEOUT_S,
    TRAIN,
    Command,
    blocks,
    flag,
    page_files,
    shell_commands,
    steps_for,
    train_args,
)
from readme_stand_ins import needs, run_stand_in, stand_in_of


@pytest.fixture(scope="module")
def command_env(tmp_path_factory):
    """The environment the commands run in: the CPU platform, the device count each
    command's own flags give (as ``helpers.run_module``), ``python`` this interpreter, a
    cache of this module's own holding the standard-library corpus (the GPT's default)
    with its held-out split cut to its first ``EVAL_TOKENS`` tokens, and XLA's compiled
    programs shared by this session's workers (each program compiles once)."""
    from jaxdist.data import text, tokens

    cache = tmp_path_factory.mktemp("readme-cache")
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's: popen-gwN in the session's
        session = session.parent
    held_out = text.stdlib_corpus(cache, progress=False)["eval"]
    meta = tokens.read_sidecar(held_out)
    ids = np.fromfile(held_out, dtype=meta["dtype"])[:EVAL_TOKENS]
    tokens.write_token_file(
        held_out,
        ids,
        vocab_size=meta["vocab_size"],
        documents=1,
        sources=f"{meta['sources']}, held-out split cut to {EVAL_TOKENS} tokens by the test",
    )
    bin_dir = cache / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXDIST_CACHE": str(cache)}
    env["JAX_COMPILATION_CACHE_DIR"] = str(session / "readme-commands-xla")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("commands", blocks())
def test_block_runs_as_printed(commands, command_env, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    for name, content in page_files(commands[0].page).items():
        (work / name).write_text(content)
    for command in commands:
        module = EXTRAS.get(command.extra or "", "")
        if command.extra and not module:
            pytest.fail(f"{command.where}: # extra: {command.extra} is not one of {set(EXTRAS)}")
        wanted = [(command.extra, module)] if module else []
        for extra, name in wanted + needs(command):
            if importlib.util.find_spec(name) is None:
                pytest.skip(f"{command.where} needs the {extra} extra: pip install -e "
                            f"'.[{extra}]' (CI's full tier installs it)")  # fmt: skip
    runs_seen: dict[str, int] = {}
    for command in commands:
        if command.skip:
            if stand_in_of(command):  # what the line leaves, made here (readme_stand_ins.py)
                print(f"{command.where}: a stand-in: {run_stand_in(command, work)}")
            continue
        tokens, line = command.tokens, command.code
        steps = None
        if command.expect is None and train_args(tokens):
            last = max(i for i in range(len(tokens)) if tokens[i : i + 3] == TRAIN)
            assert not SEPARATORS & set(tokens[last:]), f"{command.where}: the trainer last"
            steps = steps_for(tokens, runs_seen)
            line += f" --steps {steps} --log-every 1"
        before, cpu_before = runs_in(work), children_cpu_s()
        proc = subprocess.run(
            ["bash", "-c", line],
            cwd=work,
            env=command_env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        print(f"{command.where}: {children_cpu_s() - cpu_before:.1f} s of CPU: {line}")
        output = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        said = f"{command.where}: {line}\n{output}"
        assert proc.returncode == (command.expect or 0), said
        printed = {text.strip() for text in (proc.stdout + proc.stderr).splitlines()}
        for expected in command.output:
            assert expected in printed, f"{said}\n--- expected the line\n{expected}"
        if command.expect is not None:
            check_failure(command, proc, work, before, said)
        elif "--dry-run" in tokens:  # compiles and reports: no run directory, no data
            assert runs_in(work) == before, f"{said}\na dry run made {runs_in(work) - before}"
            assert "jaxdist: dry run:" in proc.stdout, said
        elif steps is not None:
            run_dir = flag(tokens, "--run-dir")
            if run_dir is None:
                made = runs_in(work) - before
                assert len(made) == 1, f"{said}\nexpected one new directory in runs/: {made}"
                run_dir = made.pop()
            check_run(work / run_dir, tokens, steps, said)
            runs_seen[run_dir] = runs_seen.get(run_dir, 0) + 1
        check_outputs(tokens, work, said)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def runs_in(work: Path) -> set[str]:
    runs = work / "runs"
    return {f"runs/{p.name}" for p in runs.iterdir()} if runs.is_dir() else set()


def check_run(run_dir: Path, tokens: list[str], steps: int, said: str) -> None:
    """What the README's run-directory section says a run writes."""
    for name in ("config.yaml", "metrics.jsonl", "goodput.json"):
        assert (run_dir / name).is_file(), f"{said}\nno {name} in {run_dir}"
    assert (run_dir / "checkpoints" / str(steps)).is_dir(), f"{said}\nno checkpoint {steps}"
    logged = [record["step"] for record in metrics_of(run_dir)]
    assert logged == list(range(1, steps + 1)), f"{said}\nmetrics.jsonl steps {logged}"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["run_dir"] == "", f"{said}\nconfig.yaml names its run_dir"
    if "--no-tensorboard" not in tokens:
        assert any((run_dir / "tb").iterdir()), f"{said}\nno TensorBoard files"
    if flag(tokens, "--profile"):
        assert (run_dir / "profile").is_dir(), f"{said}\nno profile/"


def check_outputs(tokens: list[str], work: Path, said: str) -> None:
    """The files a data or report command says it writes."""
    if tokens[:4] == ["python", "-m", "jaxdist.data", "prepare"]:
        out = work / flag(tokens, "--out")
        names = ["train.bin"]
        if float(flag(tokens, "--eval-fraction") or 0.02) > 0:
            names.append("eval.bin")
        for name in names:
            assert (out / name).is_file(), f"{said}\nno {name}"
            assert (out / f"{name}.json").is_file(), f"{said}\nno sidecar of {name}"
    if tokens[:3] == ["python", "-m", "jaxdist.report"]:
        page = work / flag(tokens, "--out")
        assert page.is_file(), f"{said}\nno {page.name}"
        assert list(page.parent.glob(f"{page.stem}-*.png")), f"{said}\nno PNGs beside it"


def check_failure(command: Command, proc, work: Path, before: set[str], said: str) -> None:
    """A command meant to fail: bad input is one line and writes nothing; a hang leaves
    its report."""
    run_dir = flag(command.tokens, "--run-dir")
    if command.expect == 2:
        lines = [text for text in proc.stderr.splitlines() if text.strip()]
        assert len(lines) == 1 and lines[0].startswith("jaxdist: error: "), said
        assert runs_in(work) == before, f"{said}\nbad input wrote a run directory"
        assert run_dir is None or not (work / run_dir).exists(), said
    if command.expect == 77:
        assert (work / run_dir / "hang-report.txt").is_file(), f"{said}\nno hang-report.txt"
        causes = [record["cause"] for record in failures_of(work / run_dir)]
        assert causes == ["hang"], f"{said}\nfailures.jsonl: {causes}"


# --- every line accounted for


def test_every_shell_line_runs_or_is_marked(capsys):
    commands = shell_commands()
    neither = [f"{c.where}: {c.code}" for c in commands if not c.skip and not c.runnable]
    assert not neither, "neither runnable here nor marked # needs: / # server:\n" + "\n".join(
        neither
    )
    stand_ins = [c for c in commands if stand_in_of(c)]  # replaced, not skipped
    skipped = [c for c in commands if c.skip and not stand_in_of(c)]
    ran = len(commands) - len(skipped) - len(stand_ins)
    with capsys.disabled():
        print(f"\nREADME and docs: {ran} commands run, {len(stand_ins)} by a stand-in, "
              f"{len(skipped)} skipped (marked)")  # fmt: skip
    assert len(skipped) <= MAX_SKIPPED, (
        f"{len(skipped)} lines skipped: the ones that cannot run here are to stay a small set "
        "(raise MAX_SKIPPED only for a command that truly cannot run in this test)"
    )


def test_skipped_commands_still_parse():
    """A line that cannot run here still names real flags with valid values."""
    from jaxdist.errors import ConfigError
    from jaxdist.train import config as config_lib

    for command in shell_commands():
        if not command.skip:
            continue
        for args in train_args(command.tokens):
            assert "--config" not in args, f"{command.where}: cannot check --config here"
            try:
                config_lib.parse_args(args)
            except ConfigError as err:
                pytest.fail(f"{command.where}: {command.code}\n{err}")
