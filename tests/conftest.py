"""8 emulated CPU devices for every test, set before JAX initialises its backend; the two
tiers (``pytest``: the quick tier, the tests not marked ``full``; ``pytest --full``:
every test, as CI runs them; tests/README.md says how a test is assigned)."""

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

from tiers import fast_compile_flags  # the XLA flags below, set before JAX starts

os.environ["JAX_PLATFORMS"] = "cpu"
# Prepared corpora go to a fresh cache per test session (and subprocesses inherit it).
os.environ["JAXDIST_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")
atexit.register(shutil.rmtree, os.environ["JAXDIST_CACHE"], ignore_errors=True)
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# XLA:CPU's LLVM code generation at its lowest effort, for every test and the processes
# the tests start. The tests' models are tiny, so compiling is most of a test's time: on
# 2 cores test_pipeline.py + test_layouts.py took 133 s with LLVM's default effort and
# 82 s with this. The HLO passes (fusion, sharding, collectives) are untouched; only
# machine-code quality drops, and every comparison in the suite is run under it alike.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA:CPU's loop emitters for its fusions instead of the newer MLIR fusion emitters: the
# same fusions, compiled in about half the time (a GPT step on data=2,fsdp=2,model=2: 4.4
# -> 2.2 s; a pipelined Llama's on stage=2,fsdp=2,model=2: 11.4 -> 6.7 s), the steps as
# fast and the losses the same. Used where this jaxlib's XLA knows the flag (XLA aborts on
# a flag it does not know).
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "JAXDIST_TEST_XLA_FLAGS" not in os.environ:  # the first process: workers inherit it
    os.environ["JAXDIST_TEST_XLA_FLAGS"] = fast_compile_flags(FAST_COMPILE, LOOP_EMITTERS)
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} {os.environ['JAXDIST_TEST_XLA_FLAGS']}".strip()
)

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxdist.cluster import cpu_backend  # noqa: E402

cpu_backend.size_thread_pool(8)  # jaxdist's own pool size, before the backend starts

jax.config.update("jax_num_cpu_devices", 8)
# XLA's persistent compilation cache for the programs compiled in the tests' own processes
# (a resumed run's step is its first run's; a reference is another test's), one folder
# for the session that both workers share. Processes the tests start do not use it: each
# is given --compile-cache or not as its test says. Safe for the pipeline on CPU since
# the thread pool above (tests/test_collective_order.py).
if "JAXDIST_TEST_XLA_CACHE" not in os.environ:  # the first process: workers inherit it
    os.environ["JAXDIST_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_XLA_CACHE"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
assert jax.device_count() == 8, jax.devices()


@pytest.fixture
def launcher(tmp_path):
    """``launcher(*args)`` starts ``python -m jaxdist.launch ARGS`` (``group_helpers``);
    every process ever seen below it is killed at teardown."""
    from group_helpers import Launcher

    started = []

    def start(*args: str, env: dict | None = None, cwd=None):
        started.append(Launcher(tmp_path, *args, env=env, cwd=cwd))
        return started[-1]

    yield start
    for one in started:
        one.close()


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """Uninterrupted runs with checkpoints, each trained once (``finished_runs``)."""
    from finished_runs import finished_runs

    return finished_runs(tmp_path_factory)


@pytest.fixture(autouse=True)
def session_compilation_cache():
    """The session's cache again after a test whose run said ``--compile-cache off``."""
    yield
    jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_TEST_XLA_CACHE"])


@pytest.fixture(autouse=True)
def no_watchdog_left_running():
    """A run's watchdog must stop with it: one left running in this process would, past
    its deadline, report a hang and end the whole test session (exit 77)."""
    yield
    import threading
    import time

    deadline = time.monotonic() + 3  # a stopped watchdog ends within one poll
    while any(t.name == "jaxdist-watchdog" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a jaxdist watchdog is still running after the test"
        time.sleep(0.02)


# --- the two tiers


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="the full tier: every test, as CI runs them (default: the quick tier, "
        "without the tests marked full)",
    )
    parser.addoption(
        "--record-passed",
        metavar="FILE",
        help="write the node ids of the tests that passed to FILE (CI's first run)",
    )
    parser.addoption(
        "--skip-passed",
        metavar="FILE",
        help="leave out the tests a --record-passed run passed (CI's second run)",
    )


def pytest_collection_modifyitems(config, items):
    """Marks the tests tests/full_tier.txt lists ``full``; without --full leaves out every
    test marked so (there, or in its file)."""
    from tiers import bare, full_tier, in_list, read_passed

    listed = full_tier()
    for item in items:
        if in_list(item.nodeid, listed):
            item.add_marker(pytest.mark.full)
    if record := config.getoption("--skip-passed"):
        passed = read_passed(Path(record))
        _leave_out(config, items, lambda item: bare(item.nodeid) in passed)
    if config.getoption("--full"):
        return
    _leave_out(config, items, lambda item: item.get_closest_marker("full"))


def _leave_out(config, items, which) -> None:
    left = [item for item in items if which(item)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not which(item)]


def pytest_configure(config):
    from tiers import PassedRecord

    record = config.getoption("--record-passed")
    if record and not hasattr(config, "workerinput"):  # the controller sees every report
        config.pluginmanager.register(PassedRecord(Path(record)), "jaxdist-passed-record")


def pytest_sessionstart(session):
    from deadline import reports_dir

    reports_dir()  # made here, so that the workers inherit it
    session.config.stash[_STARTED] = time.monotonic()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test under a deadline (``deadline.py``): a hang fails that test, by name."""
    from deadline import Deadline, limit_s

    deadline = Deadline(limit_s())
    deadline.arm(item.nodeid)
    try:
        return (yield)
    finally:
        deadline.disarm()


def pytest_terminal_summary(terminalreporter, config):
    """The tier and its wall time, the last line before pytest's own summary."""
    started = config.stash.get(_STARTED, None)
    if started is None:
        return
    wall = time.monotonic() - started
    if config.getoption("--full"):
        said = "the full tier"
    else:
        said = "the quick tier (pytest --full runs every test)"
    from deadline import reports

    for report in reports():  # tests past their deadline, with their threads' stacks
        terminalreporter.write_line(report[-20000:])
    terminalreporter.write_line(f"jaxdist tests: {said}, {wall:.0f} s wall")


_STARTED = pytest.StashKey[float]()
