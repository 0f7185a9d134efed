"""Who we are: the process group, and what only the main process does.

PyTorch's ``init_process_group`` / ``rank`` / ``world_size`` / ``barrier`` map to
``initialize()``, ``ProcessInfo.process_index`` / ``process_count`` and ``barrier()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import jax

from jaxdist import cluster, coordination, failures, peers
from jaxdist.cluster import ClusterSpec
from jaxdist.coordinator import claim_process_zero, service_address
from jaxdist.errors import JaxdistError

EXIT_PEER_FAILURE = failures.PEER_DIED  # the group did not form, or a peer died
EXIT_TERMINATED = failures.TERMINATED  # 143, as a shell reports a death by SIGTERM


@dataclass(frozen=True)
class ProcessInfo:
    process_index: int  # PyTorch's rank (of the process, not of the device)
    process_count: int  # PyTorch's world_size counts devices; this counts processes
    local_device_count: int  # devices this process drives
    device_count: int  # devices in the whole job
    platform: str  # "cpu", "gpu" or "tpu"

    def __str__(self) -> str:
        return (
            f"process {self.process_index}/{self.process_count}: "
            f"{self.local_device_count} local of {self.device_count} {self.platform} devices"
        )


def use_cpu_devices(count: int) -> None:
    """Emulates ``count`` CPU devices. Only possible before JAX initialises its backend;
    afterwards it is accepted only if the backend already has exactly that many."""
    if not count:
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        devices = jax.devices()
        if devices[0].platform != "cpu" or len(devices) != count:
            raise JaxdistError(
                f"--cpu-devices {count}: JAX's backend is already initialised with "
                f"{len(devices)} {devices[0].platform} devices; set it before any JAX operation "
                f"(or JAX_NUM_CPU_DEVICES={count} in the environment)"
            ) from None


def select_platform(name: str | None) -> None:
    """``JAXDIST_PLATFORM=cpu`` (or gpu, tpu) picks the platform before JAX starts."""
    if name:
        jax.config.update("jax_platforms", {"gpu": "cuda"}.get(name, name))


def _join(
    spec: ClusterSpec, init_timeout: float, heartbeat_timeout: float, bind: str, health: bool
) -> None:
    """jax.distributed.initialize, bounded: if the group has not formed within
    ``init_timeout`` s we exit with a clear message. (JAX's own timeout aborts the process
    with SIGABRT and a C++ stack trace, so ours fires first; it runs while JAX waits,
    because JAX releases the GIL.) With ``health``, a second process claiming the same
    process id is named within seconds (``jaxdist.coordinator``, ``jaxdist.peers``)."""
    waited_for = (
        f"the coordinator {spec.coordinator}" if spec.coordinator else "the SLURM coordinator"
    )
    bind_address = service_address(spec, bind)
    if health:
        peers.install_abort_handler(spec.process_id, spec.num_processes)
        if spec.process_id == 0 and bind_address:
            claim_process_zero(spec, bind_address)

    def give_up():
        listens = f"; it listens on {bind_address}" if bind_address else ""
        print(
            f"[rank {spec.process_id}] jaxdist: error: the process group did not form within "
            f"--init-timeout {init_timeout:g}s: process {spec.process_id} of "
            f"{spec.num_processes} waited for {waited_for} ({spec.source}{listens}). A "
            "process that never started, or one given the same process id as another, "
            "keeps the group from forming",
            file=sys.stderr,
            flush=True,
        )
        peers.exit_now(EXIT_PEER_FAILURE)

    watchdog = threading.Timer(init_timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    kwargs = dict(
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        initialization_timeout=int(init_timeout) + 30,
        heartbeat_timeout_seconds=int(heartbeat_timeout),
        coordinator_bind_address=bind_address or None,
    )
    if spec.source == "slurm":
        jax.distributed.initialize(**kwargs)  # JAX reads SLURM's environment itself
    else:
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id, **kwargs)
    watchdog.cancel()
    peers.joined(coordination.coordinator_address())
    _exit_fast_on_uncaught_error(spec.process_id)
    _exit_on_sigterm()


def _exit_on_sigterm() -> None:
    """SIGTERM exits at once with 143. jax.distributed.initialize hands SIGTERM to JAX's
    preemption notifier, which keeps the process running (shared/jax-notes fact 2), so
    neither a launcher ending its group, nor SLURM, nor ``kill`` could end it; a handler
    installed after initialize replaces the notifier. A Python handler runs only when the
    main thread is in Python, not while it waits in XLA (a collective whose peer died,
    a long step), so a thread woken by the signal through the wakeup fd exits too."""
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can only be installed from the main thread
    signal.signal(signal.SIGTERM, _ignore_in_main_thread)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(
        target=_watch_signals, args=(read_fd, previous), daemon=True, name="jaxdist-sigterm"
    ).start()


def _watch_signals(read_fd: int, previous_fd: int) -> None:
    while True:
        numbers = os.read(read_fd, 512)  # one byte per signal that has a Python handler
        if previous_fd >= 0:  # whoever had the wakeup fd before still gets woken
            with contextlib.suppress(OSError):
                os.write(previous_fd, numbers)
        for _ in range(numbers.count(signal.SIGTERM)):
            _SIGTERM_STOP.received()


class _SigtermStop:
    """What SIGTERM does once the group has formed: exit 143 at once, unless a training
    loop asked for a clean stop (``stop_on_sigterm``): then the first SIGTERM calls its
    callback and only a second one exits. Process-wide, as signal handlers are."""

    def __init__(self):
        self.callback = None
        self.count = 0

    def received(self) -> None:
        self.count += 1
        if self.callback is None or self.count > 1:
            _terminate()
        self.callback()


_SIGTERM_STOP = _SigtermStop()


def sigterm_watched() -> bool:
    """Whether SIGTERM goes through ``jaxdist.initialize``'s watcher (a process group)."""
    return signal.getsignal(signal.SIGTERM) is _ignore_in_main_thread


def stop_on_sigterm(callback) -> None:
    """In a process group: the first SIGTERM calls ``callback`` instead of exiting."""
    _SIGTERM_STOP.callback = callback


def _ignore_in_main_thread(signum, frame) -> None:
    # The watcher thread acts on every SIGTERM (it is woken even while the main thread
    # waits in XLA); the main thread's handler only makes Python write the wakeup fd.
    pass


def _terminate(signum=None, frame=None) -> None:
    # Flushed from another thread, with a time limit: the interrupted main thread may hold
    # a stream's lock (or be blocked writing to a full pipe).
    peers.expect_exit(EXIT_TERMINATED)
    flusher = threading.Thread(target=_flush, daemon=True)
    flusher.start()
    flusher.join(timeout=1)
    os._exit(EXIT_TERMINATED)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_fast_on_uncaught_error(process_id: int) -> None:
    """An uncaught exception prints with a ``[rank N]`` prefix and exits at once with 1.
    A normal interpreter exit would wait in JAX's shutdown barrier for the other
    processes (which keep running), up to the shutdown timeout, and then abort."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        lines = traceback.format_exception(kind, value, tb)
        text = "".join(lines).rstrip("\n").replace("\n", f"\n[rank {process_id}] ")
        print(f"[rank {process_id}] {text}", file=sys.stderr, flush=True)
        if kind is KeyboardInterrupt:
            previous(kind, value, tb)
        peers.exit_now(failures.FAILED)

    sys.excepthook = hook


def exit_now(code: int) -> None:
    """Ends the process with ``code``. With several processes and a non-zero code, skips
    JAX's shutdown barrier (it would wait for peers that are still training)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code and jax.distributed.is_initialized() and jax.process_count() > 1:
        if code == failures.PREEMPTED:
            _leave_together()
        peers.exit_now(code)
    peers.expect_exit(code)  # JAX's client aborting during a normal shutdown keeps it
    sys.exit(code)


def _leave_together(timeout_s: float = 30) -> None:
    """A preemption stops every process at the same step, but they finish saving and
    reporting at different moments. Process 0 hosts the coordination service: leaving
    first would kill it under the others, whose clients then abort mid-report. So all
    meet at a barrier of the store, and process 0 leaves last."""
    peers.expect_exit(failures.PREEMPTED)  # a client abort on the way out keeps 75
    try:
        coordination.barrier("jaxdist/exit/preempted", timeout_s)
    except Exception:  # a peer already gone: nothing to wait for
        return
    if jax.process_index() == 0:
        time.sleep(0.5)  # the others' exits, before the service goes


def initialize(
    cpu_devices: int = 0,
    *,
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    local_device_ids: str = "",
    init_timeout: float = 300,
    heartbeat_timeout: float = 100,
    coordinator_bind_address: str = "",
    health: bool = True,
) -> ProcessInfo:
    """Sets up the process group and returns who we are. Call once, before other JAX use.

    Where the group comes from, first that applies (see ``jaxdist.cluster``): a SLURM step
    with several tasks; the explicit arguments; ``JAXDIST_COORDINATOR`` /
    ``JAXDIST_NUM_PROCESSES`` / ``JAXDIST_PROCESS_ID`` (set by ``python -m jaxdist.launch``)
    or PyTorch's ``MASTER_ADDR`` / ``MASTER_PORT`` / ``WORLD_SIZE`` / ``RANK`` /
    ``LOCAL_RANK``; else one process. ``cpu_devices=8`` emulates 8 CPU devices per process;
    ``JAXDIST_PLATFORM`` picks the platform. CPU processes talk through gloo. In a group,
    SIGTERM then ends the process at once with exit code 143, as it would without JAX,
    unless a ``jaxdist.preempt.StopFlag`` takes it as a request to stop cleanly.

    Process 0's coordination service listens on ``coordinator_bind_address``, else on
    the address of the coordinator host given (not on every interface, JAX's default:
    the service has no authentication); under SLURM on JAX's default unless given.
    ``health``: a process aborted by JAX's coordination client says why, naming the
    process that died or the duplicate process id (``jaxdist.peers``).

    Example::

        info = jaxdist.initialize()
        print(info)  # process 0/2: 4 local of 8 cpu devices
    """
    select_platform(os.environ.get("JAXDIST_PLATFORM"))
    use_cpu_devices(cpu_devices)
    spec = cluster.resolve(os.environ, coordinator, num_processes, process_id, local_device_ids)
    if spec.multi_process and not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _join(spec, init_timeout, heartbeat_timeout, coordinator_bind_address, health)
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        platform=jax.devices()[0].platform,
    )


def is_main_process() -> bool:
    """True on process 0, the one that writes files and prints."""
    return jax.process_index() == 0


def print_main(*args, **kwargs) -> None:
    """``print`` on the main process only (PyTorch: ``if rank == 0: print(...)``)."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier of the same ``name``."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
