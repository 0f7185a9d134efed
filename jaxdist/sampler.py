"""Which examples each process reads: ``DistributedSampler`` (training) and
``EvalSampler`` (every held-out example exactly once, padded and masked).

Training: a global order (a permutation of the dataset from (seed, epoch)) is cut into
global batches of G examples: step k takes positions [k*G, (k+1)*G) of that order.
Process p takes its contiguous G/P share, and ``shard_batch`` gives each of its devices
a contiguous share of that. So the global batch at step k does not depend on the process
or device count, no example repeats or is lost within an epoch, and resuming at step k
needs nothing but k.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from jaxdist.errors import JaxdistError


def _this_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        return jax.process_index(), jax.process_count()
    return process_index, process_count


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
    next epoch's order, and nothing is dropped.

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
    ):
        self.process_index, self.process_count = _this_process(process_index, process_count)
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
        """(num_examples,) example indices in the order of ``epoch``."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
                if self.shuffle
                else np.arange(self.num_examples)
            )
        return self._orders[epoch]

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
    ):
        self.process_index, self.process_count = _this_process(process_index, process_count)
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
