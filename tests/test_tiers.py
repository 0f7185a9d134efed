"""The suite's two tiers (tests/README.md): ``pytest`` runs the quick tier, the tests not
marked ``full``; ``pytest --full`` runs every test (CI). Every subsystem folder of
jaxdist/ keeps at least one end-to-end test in the quick tier (``QUICK_END_TO_END``), and
the tiers are what the marks say (collected here by pytest itself, in a subprocess)."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import full_tier, in_list

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxdist"

# Each subsystem folder of jaxdist/ -> a quick test that runs it end to end, as a user
# would (through a command, or the library in a loop of the test's own): (file, test).
QUICK_END_TO_END = {
    "checkpoint": (
        "test_checkpoint.py",
        "test_resumed_run_ends_with_the_uninterrupted_params_bit_for_bit",
    ),
    "cluster": ("test_launch_nodes.py", "test_two_nodes_train_as_one_process_with_their_devices"),
    "data": ("test_data_cli.py", "test_prepare_command_then_train"),
    "export": (
        "test_weights.py",
        "test_export_writes_the_trained_params_in_the_files_form_and_a_resume_skips_the_file",
    ),
    "evaluate": ("test_lm_eval.py", "test_the_jaxdist_model_scores_the_run_directory_in_place"),
    "generate": ("test_generate_cli.py", "test_a_run_directory_continues_each_prompt_as_alone"),
    "health": (
        "test_health_agreement.py",
        "test_a_different_global_batch_on_one_process_stops_both_before_step_1",
    ),
    "launch": ("test_launch_robust.py", "test_the_group_dies_with_the_launcher"),
    "models": ("test_cli.py", "test_gpt_logs_tokens_per_second"),
    "parallel": ("test_equivalence.py", "test_params_and_losses_equal_single_device_reference"),
    "plan": ("test_plan.py", "test_the_command_plans_and_its_printed_command_trains"),
    "report": ("test_report.py", "test_report_on_two_runs_of_different_lengths_one_without_eval"),
    "sinks": ("test_observe.py", "test_tensorboard_holds_each_metric_at_the_logged_steps"),
    "train": ("test_cli.py", "test_run_writes_config_and_metrics_and_learns"),
    "weights": ("test_weights.py", "test_init_from_sets_exactly_the_mapped_arrays_in_every_layout"),
}


def marked_full(marks) -> bool:
    marks = marks if isinstance(marks, list | tuple) else [marks]
    return any(getattr(m, "name", "") == "full" for m in marks)


def in_quick_tier(file: str, name: str) -> bool:
    """Whether the test ``file::name`` exists and has a case in the quick tier: neither
    its file nor the test is listed in tests/full_tier.txt or marked full in its source,
    and some case of it is not (every parametrize list of it is one factor of its cases)."""
    module = importlib.import_module(Path(file).stem)
    function = getattr(module, name, None)
    assert function is not None, f"{file}::{name}: no such test"
    listed = full_tier()
    marks = getattr(function, "pytestmark", [])
    if in_list(f"{file}::{name}", listed) or marked_full(getattr(module, "pytestmark", [])):
        return False
    if marked_full(marks):
        return False
    values = [m.args[1] for m in marks if m.name == "parametrize"]
    cases = math.prod(len(v) for v in values)
    in_source = math.prod(
        sum(not marked_full(getattr(case, "marks", ())) for case in v) for v in values
    )
    in_file = sum(entry.startswith(f"{file}::{name}[") for entry in listed)
    return in_source > 0 and in_file < cases


def test_every_subsystem_has_an_end_to_end_test_in_the_quick_tier():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert len(folders) >= 13  # the folders are read
    assert set(QUICK_END_TO_END) == folders, "a subsystem folder without its quick test"
    slow = [f"{f}::{t}" for f, t in QUICK_END_TO_END.values() if not in_quick_tier(f, t)]
    assert not slow, f"in the full tier, so not in the quick tier: {slow}"


@pytest.mark.full
def test_the_full_tier_holds_the_marked_tests(request):
    """Marked full: it runs only under --full (were the quick tier to run it, it fails)."""
    assert request.config.getoption("--full")


def collected(*args: str) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-n", "0", *args, str(Path(__file__))]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.split("::")[-1] for line in done.stdout.splitlines() if "::" in line]


def test_pytest_leaves_out_the_tests_marked_full_and_full_runs_them():
    quick, full = collected(), collected("--full")
    listed = {"test_pytest_leaves_out_the_tests_marked_full_and_full_runs_them"}  # full_tier.txt
    assert set(full) - set(quick) == {"test_the_full_tier_holds_the_marked_tests", *listed}
    assert set(quick) == {"test_every_subsystem_has_an_end_to_end_test_in_the_quick_tier"}
