"""Which examples each process reads: ``DistributedSampler`` (training) and
``EvalSampler`` (every held-out example exactly once, padded and masked).

Training: a global order (a permutation of the dataset from (seed, epoch)) is cut into
global batches of G examples: step k takes positions [k*G, (k+1)*G) of that order.
Data-parallel rank r of R (the process index on a data-only mesh; processes holding one
model replica together share a rank, given ``mesh=``) takes its contiguous G/R share,
and ``shard_batch`` gives each of its batch shards a contiguous share of that.
So the global batch at step k does not depend on the process
or device count, no example repeats or is lost within an epoch, and resuming at step k
needs nothing but k.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from jaxdist.errors import JaxdistError


def _this_process(
    process_index: int | None, process_count: int | None, mesh=None
) -> tuple[int, int]:
    """(data-parallel rank, rank count): given, from ``mesh`` (processes of one model
    group share a rank and read the same rows), else the process index and count (the
    same thing on a data-only mesh)."""
    if process_index is not None and process_count is not None:
        return process_index, process_count
    if mesh is not None:
        from jaxdist.parallel.device_mesh import data_parallel_rank

        return data_parallel_rank(mesh)
    import jax

    return jax.process_index(), jax.process_count()


def _check_share(global_batch_size: int, process_count: int, what: str) -> int:
    if global_batch_size % process_count:
        raise JaxdistError(
            f"{what} {global_batch_size} is not divisible by {process_count} processes"
        )
    return global_batch_size // process_count


class DistributedSampler:
    """PyTorch's ``DistributedSampler`` by optimizer step instead of by epoch.

    ``last_batch="drop"`` (default) drops each epoch's last partial global batch, so an
    epoch is ``num_examples // G`` steps. ``"wrap"`` reads the epochs' orders as one
    stream: a batch that crosses the end of an epoch takes its remaining rows from the
    next epoch's order, and nothing is dropped. That order's first G positions are then
    rearranged (stably) so that the rows it gives that batch are none of the examples the
    batch already has: no global batch holds an example twice, and each epoch's order is
    still a permutation, so every example is read exactly once per epoch.

    Example::

        sampler = jaxdist.DistributedSampler(len(dataset), global_batch_size=256, seed=0)
        for step in range(steps):
            host_batch = dataset[sampler.indices(step)]   # (256 / P,) example indices
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        last_batch: Literal["drop", "wrap"] = "drop",
        process_index: int | None = None,
        process_count: int | None = None,
        mesh=None,
    ):
        # The data-parallel rank and count (see _this_process), not always the process's.
        self.process_index, self.process_count = _this_process(process_index, process_count, mesh)
        self.share = _check_share(global_batch_size, self.process_count, "global batch")
        if num_examples < global_batch_size:
            raise JaxdistError(
                f"{num_examples} examples are fewer than one global batch of {global_batch_size}"
            )
        if last_batch not in ("drop", "wrap"):
            raise JaxdistError(f"last_batch: {last_batch!r} is not one of drop, wrap")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.last_batch = last_batch
        # examples read per epoch: 1000 examples, G = 64 -> 15 * 64 = 960 when dropping
        self.examples_per_epoch = (
            num_examples // global_batch_size * global_batch_size
            if last_batch == "drop"
            else num_examples
        )
        self._orders: dict[int, np.ndarray] = {}  # the last two epochs' orders

    @property
    def steps_per_epoch(self) -> int | float:
        """Whole steps when dropping (1000 examples, G = 64 -> 15); 15.625 when wrapping."""
        if self.last_batch == "drop":
            return self.examples_per_epoch // self.global_batch_size
        return self.examples_per_epoch / self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """(num_examples,) example indices in the order of ``epoch``: a permutation from
        (seed, epoch), with ``wrap`` its first positions rearranged as the class says.
        A dataset of fewer than two global batches may make an epoch's last rows depend
        on that rearrangement; those epochs are computed from the nearest one that does
        not (at most G epochs back), so the order still depends on the epoch alone."""
        if epoch not in self._orders:
            first = epoch
            while first > 0 and not self._tail_known(first - 1):
                first -= 1
            tail = self._known_tail(first - 1)
            for e in range(first, epoch + 1):
                order = self._arranged(e, tail)
                tail = order[self.num_examples - self._overhang(e) :]
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return self._orders[epoch]

    def _raw_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def _overhang(self, epoch: int) -> int:
        """How many of ``epoch``'s last positions share a global batch with the next
        epoch's first ones (``wrap``; 0 when the epoch ends on a batch boundary)."""
        if self.last_batch == "drop" or epoch < 0:
            return 0
        return self.num_examples * (epoch + 1) % self.global_batch_size

    def _arranged(self, epoch: int, head: np.ndarray) -> np.ndarray:
        """The raw order of ``epoch`` with its first G positions rearranged so that the
        first G - len(head) are none of ``head`` (the previous epoch's overhang, in the
        same batch); the others follow in their raw order. Among G positions at most
        len(head) are in ``head``, so there are enough."""
        raw = self._raw_order(epoch)
        if not len(head):
            return raw
        g = self.global_batch_size
        window = raw[:g]
        firsts = np.flatnonzero(~np.isin(window, head))[: g - len(head)]
        later = np.ones(len(window), bool)
        later[firsts] = False
        return np.concatenate([window[firsts], window[later], raw[g:]])

    def _tail_known(self, epoch: int) -> bool:
        """Whether ``epoch``'s overhang is known without computing earlier epochs: its
        order is cached, or is the raw one past the first G positions."""
        n, g = self.num_examples, self.global_batch_size
        return (
            epoch in self._orders
            or self._overhang(epoch - 1) == 0
            or (n - self._overhang(epoch) >= g)
        )

    def _known_tail(self, epoch: int) -> np.ndarray:
        """``epoch``'s overhang, when ``_tail_known(epoch)``; empty before epoch 0."""
        start = self.num_examples - self._overhang(epoch)
        if epoch in self._orders:
            return self._orders[epoch][start:]
        return self._raw_order(epoch)[start:] if epoch >= 0 else np.zeros(0, np.int64)

    def global_indices(self, step: int) -> np.ndarray:
        """(G,) the indices of the whole global batch of ``step``, on every process."""
        return self._positions(step * self.global_batch_size, self.global_batch_size)

    def indices(self, step: int) -> np.ndarray:
        """(G/P,) this process's contiguous share of the global batch of ``step``."""
        start = step * self.global_batch_size + self.process_index * self.share
        return self._positions(start, self.share)

    def _positions(self, start: int, count: int) -> np.ndarray:
        """Example indices at global stream positions [start, start + count)."""
        out = []
        while count:
            epoch, offset = divmod(start, self.examples_per_epoch)
            take = min(count, self.examples_per_epoch - offset)
            out.append(self.epoch_order(epoch)[offset : offset + take])
            start, count = start + take, count - take
        return out[0] if len(out) == 1 else np.concatenate(out)


class EvalSampler:
    """Every example of a held-out set exactly once, in order, in global batches of G.

    The last batch is padded to G rows (with example 0) and ``mask`` is 0 on the
    padding, so sums weighted by the mask count each example once on any device count:
    1001 examples, G = 64 -> 16 batches, the last with 41 real rows and 23 masked.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
        mesh=None,
    ):
        self.process_index, self.process_count = _this_process(process_index, process_count, mesh)
        self.share = _check_share(global_batch_size, self.process_count, "eval batch")
        if num_examples < 1:
            raise JaxdistError("the held-out set is empty")
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.steps = -(-num_examples // global_batch_size)  # ceil

    def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This process's (G/P,) example indices and (G/P,) float32 mask for ``step``."""
        start = step * self.global_batch_size + self.process_index * self.share
        positions = np.arange(start, start + self.share)
        real = positions < self.num_examples
        return np.where(real, positions, 0), real.astype(np.float32)
