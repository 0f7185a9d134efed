"""Replica fingerprints: the data-parallel copies of every parameter must stay equal.

Data parallelism keeps one copy of each parameter (or of each shard of it) per replica
and applies the same averaged update to all. A bit flipped in one device's memory, or
a nondeterministic kernel, makes the copies drift apart silently, and the next
checkpoint saves whichever copy process 0 holds. Every ``--check-replicas-every N``
steps, and before every checkpoint, each device computes a fingerprint of each of its
parameter blocks (``checkpoint.fingerprint``: one pass over the bits, the cost of
reading the parameters once), the (devices, parameters) table is all-gathered, and the
devices that hold the same block are compared. A difference stops the run naming the
parameter path, the device and its process (``failures.DIVERGED``, exit 79).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.checkpoint.verify import fingerprint
from jaxdist.parallel.host import host_value


class ReplicaDivergenceError(RuntimeError):
    """Replicas of a parameter differ (exit code 79)."""


class ReplicaCheck:
    """``check(state, step)`` for the params of a ``Parallel``'s state."""

    def __init__(self, dp):
        self.mesh = dp.mesh
        self.copies = bool(dp.layout.copies)  # pmap: (N, ...) stacked copies, all equal
        self._shardings = (
            None if self.copies else jax.tree.leaves(dp.state_sharding.params, is_leaf=_is_sharding)
        )
        self.paths: list[str] = []
        self.specs: list[P] = []
        self.devices = list(self.mesh.devices.reshape(-1))  # the table's rows, in order
        self._fn = None

    def _build(self, params):
        self.paths = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(params)]
        if self.copies:
            self.specs = [P("data")] * len(self.paths)
            self._fn = jax.jit(lambda blocks: jnp.stack([fingerprint(b) for b in blocks]))
            return
        self.specs = [s.spec for s in self._shardings]
        axes = tuple(self.mesh.axis_names)

        def local(*blocks):  # on each device: its blocks -> (1, L) fingerprints -> (D, L)
            mine = jnp.stack([fingerprint(b) for b in blocks])[None]
            return jax.lax.all_gather(mine, axes, tiled=True)

        mapped = jax.shard_map(
            local, mesh=self.mesh, in_specs=tuple(self.specs), out_specs=P(), check_vma=False
        )
        self._fn = jax.jit(lambda tree: mapped(*jax.tree.leaves(tree)))

    def prepare(self, params) -> None:
        """Compiles the check for ``params`` now (e.g. with the first step, which compiles
        anyway) rather than at the first check, where it would stall a running loop.
        pmap's per-device programs compile on first use."""
        if self._fn is None:
            self._build(params)
            if not self.copies:
                self._fn = self._fn.lower(params).compile()

    def fingerprints(self, params) -> np.ndarray:
        """(devices, parameters) uint32, rows in ``self.devices`` order, the same on
        every process."""
        if self._fn is None:
            self._build(params)
        if self.copies:
            return self._copies_table(params)
        return np.asarray(host_value(self._fn(params)))

    def _copies_table(self, params) -> np.ndarray:
        """pmap's copies live on this process's devices only (its outputs span no other
        process): each device's row here, then the rows of every process gathered."""
        leaves = jax.tree.leaves(params)
        local = [s.device for s in leaves[0].addressable_shards]
        rows = []
        for i in range(len(local)):  # one program per device, on that device's blocks
            rows.append(np.asarray(self._fn([x.addressable_shards[i].data for x in leaves])))
        table, ids = np.stack(rows), np.array([d.id for d in local])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            table = np.asarray(multihost_utils.process_allgather(table)).reshape(-1, len(leaves))
            ids = np.asarray(multihost_utils.process_allgather(ids)).reshape(-1)
        by_id = {d.id: d for d in jax.devices()}
        self.devices = [by_id[int(i)] for i in ids]
        return table

    def check(self, params, step: int) -> None:
        table = self.fingerprints(params)
        for leaf, (path, spec) in enumerate(zip(self.paths, self.specs, strict=True)):
            for group in self._holders(spec):
                values = table[group, leaf]
                if (values == values[0]).all():
                    continue
                err = ReplicaDivergenceError(self._message(step, path, group, values))
                err.step, err.process = step, self._odd_devices(group, values)[0].process_index
                raise err

    def _holders(self, spec) -> list[list[int]]:
        """Groups of table rows (devices) that hold the same block."""
        if self.copies:
            return [list(range(len(self.devices)))]
        names = tuple(self.mesh.axis_names)
        sharded = set() if self.copies else {a for part in spec if part for a in _axes(part)}
        shape = [self.mesh.shape[a] for a in names]
        groups: dict[tuple, list[int]] = {}
        for flat, coords in enumerate(itertools.product(*map(range, shape))):
            key = tuple(c for a, c in zip(names, coords, strict=True) if a in sharded)
            groups.setdefault(key, []).append(flat)
        return [g for g in groups.values() if len(g) > 1]

    def _odd_devices(self, group: list[int], values: np.ndarray) -> list:
        """The devices whose value is not the most common one (the majority)."""
        return [self.devices[group[i]] for i, v in enumerate(values) if v != _majority(values)]

    def _message(self, step: int, path: str, group: list[int], values: np.ndarray) -> str:
        odd = self._odd_devices(group, values)
        odd_values = [
            f"{int(v):#010x}" for i, v in enumerate(values) if self.devices[group[i]] in odd
        ]
        named = ", ".join(f"device {d} (process {d.process_index})" for d in odd[:4])
        return (
            f"step {step}: the data-parallel replicas of params/{path} differ: {named} "
            f"{'holds' if len(odd) == 1 else 'hold'} fingerprint {', '.join(odd_values[:4])}, "
            f"the other {len(group) - len(odd)} replica(s) {_majority(values):#010x}"
        )


def _majority(values: np.ndarray):
    kinds, counts = np.unique(values, return_counts=True)
    return kinds[np.argmax(counts)]


def _axes(part) -> tuple[str, ...]:
    return part if isinstance(part, tuple) else (part,)


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)
