"""The trainer's distributed health, in one object: the watchdog (hang reports), the
agreement rounds (every process runs the same thing), replica fingerprints, dead-peer
naming, and the fault injection the tests use. ``--no-health`` leaves JAX's own
behaviour (for comparison: ``experiments/faults.py``), except the faults.
"""

from __future__ import annotations

from functools import partial

import jaxdist
from jaxdist.cluster import peers
from jaxdist.health import agreement, hang_report
from jaxdist.health.deadlines import Deadlines
from jaxdist.health.fault_injection import Faults
from jaxdist.health.replica_check import ReplicaCheck
from jaxdist.health.watchdog import Watchdog
from jaxdist.train.config import DistConfig


class RunHealth:
    def __init__(self, d: DistConfig, info: jaxdist.ProcessInfo):
        self.enabled = d.health
        self.every = d.check_replicas_every if d.health else 0
        # One process has no one to agree with: nothing to lower, hash or compare.
        self.agreeing = d.health and info.process_count > 1
        self._dist = d
        self.faults = Faults.from_env(info.process_index)
        self.deadlines = Deadlines(
            step_s=d.step_timeout,
            slow_s=d.slow_phase_timeout,
            silent_s=max(5.0, d.heartbeat_timeout / 2),  # named before JAX's heartbeat aborts
        )
        self.watch: Watchdog | NullWatch = NullWatch()
        if self.enabled:
            self.watch = Watchdog(
                info.process_index,
                info.process_count,
                self.deadlines,
                on_hang=hang_report.handle,
                on_peer_ending=peers.end_for_peer_ending,
            ).start()
            peers.watch(self.watch)
        self._replicas: ReplicaCheck | None = None
        self._rounds = 0
        self._dp = self._save_dir = None

    def describe(self) -> str:
        if not self.enabled:
            return "health checks off (--no-health): JAX's own timeouts only"
        replicas = (
            f"replicas compared every {self.every} steps and before each checkpoint"
            if self.every
            else "replicas not compared"
        )
        d = self._dist
        return (
            f"deadlines: --init-timeout {d.init_timeout:g}s, --heartbeat-timeout "
            f"{d.heartbeat_timeout:g}s, {self.deadlines.describe()}; {replicas}"
        )

    def agree_setup(self, config: dict, info: jaxdist.ProcessInfo) -> None:
        """The resolved config (``config.to_dict``), versions and counts, before any data
        is read."""
        if self.agreeing:
            fields = agreement.setup_fields(config, info)
            agreement.agree("setup", fields, timeout_s=self.deadlines.slow_s + 10)

    def agree_program(self, dp: jaxdist.Parallel, batch, save_dir) -> None:
        """Mesh, layout and the lowered step for global batches shaped like ``batch``;
        again whenever the step meets batches of other shapes (it would recompile)."""
        if not self.agreeing:
            return
        self._dp, self._save_dir = dp, save_dir
        self._agree_program(dp.program(batch), batch)
        dp.on_new_batch_shapes(self._agree_program, known=batch)

    def _agree_program(self, program, batch) -> None:
        if self._dp.layout.copies:
            # JAX's pmap reads abstract inputs as one process's part and fails to lower
            # them across processes: its program is not compared (config, versions,
            # mesh and layout still are).
            text = "pmap across processes: not lowered"
        else:
            text = program.fn.lower(program.state, program.abstract_batch(batch)).as_text()
        fields = agreement.program_fields(self._dp.mesh, self._dp.state_sharding, text)
        self._rounds += 1
        agreement.agree(
            f"program-{self._rounds}",
            fields,
            timeout_s=self.deadlines.slow_s + 10,
            program_text=text,
            save_dir=self._save_dir,
        )

    def close(self, *, finished: bool) -> None:
        """Stops watching: ``finished``, peers are told this process is done (its silence
        is no alarm); else it just stops (it failed: to them, it is silent)."""
        if finished:
            self.watch.finish()
        else:
            self.watch.stop()
        peers.watch(None)

    def watch_writes(self, dp: jaxdist.Parallel, sinks) -> None:
        """The watchdog also watches the writes made in the background (a checkpoint, the
        sinks' files): a stalled file system blocks them while the loop trains on."""
        if isinstance(self.watch, Watchdog):
            self.watch.writers = [partial(_checkpoint_write, dp), sinks.in_flight]

    def wants_check(self, step: int, *, saving: bool) -> bool:
        """Replicas are compared every ``--check-replicas-every`` steps, and before a
        checkpoint (``saving``); never with 0 or ``--no-health``."""
        return bool(self.every) and (saving or step % self.every == 0)

    @property
    def first_check(self) -> bool:
        """The next check is the first: it compiles (a slow phase)."""
        return self._replicas is None

    def prepare_checks(self, dp: jaxdist.Parallel, state) -> None:
        """Compiles the replica check ahead of its first use, if there will be one."""
        if self.every and self._replicas is None:
            self._replicas = ReplicaCheck(dp)
            self._replicas.prepare(state.params)

    def check_replicas(self, dp: jaxdist.Parallel, state, step: int) -> None:
        """Compares the replicas now (the loop asks ``wants_check`` first)."""
        if self._replicas is None:
            self._replicas = ReplicaCheck(dp)
        self._replicas.check(state.params, step)


def _checkpoint_write(dp: jaxdist.Parallel):
    found = dp.save_in_flight()
    if found is None:
        return None
    step, seconds, path = found
    return "save", step, seconds, f"checkpoint {step} is being written to {path}"


class NullWatch:
    """The watchdog's interface, doing nothing (``--no-health``)."""

    run_dir = None

    def phase(self, name: str, step: int, *, slow: bool = False) -> None:
        pass

    def completed(self, step: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def stop(self) -> None:
        pass
