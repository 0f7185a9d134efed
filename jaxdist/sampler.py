"""``DistributedSampler``: which examples each process reads at each optimizer step.

A global order (a permutation of the dataset from (seed, epoch)) is cut into global
batches of G examples: step k takes positions [k*G, (k+1)*G) of the concatenated epochs
(the last partial batch of an epoch is dropped). Process p takes its contiguous G/P share.
So the global batch at step k does not depend on the process or device count, and
resuming at step k needs nothing but k.
"""

from __future__ import annotations

import numpy as np

from jaxdist.errors import JaxdistError


class DistributedSampler:
    """PyTorch's ``DistributedSampler`` by optimizer step instead of by epoch.

    Example::

        sampler = jaxdist.DistributedSampler(len(dataset), global_batch_size=256, seed=0)
        for step in range(steps):
            rows = [dataset[i] for i in sampler.indices(step)]   # (256 / P,) indices
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if process_index is None or process_count is None:
            import jax

            process_index, process_count = jax.process_index(), jax.process_count()
        if global_batch_size % process_count:
            raise JaxdistError(
                f"global batch {global_batch_size} is not divisible by {process_count} processes"
            )
        if num_examples < global_batch_size:
            raise JaxdistError(
                f"{num_examples} examples are fewer than one global batch of {global_batch_size}"
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.steps_per_epoch = num_examples // global_batch_size  # drop the partial batch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """(num_examples,) example indices in the order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def global_indices(self, step: int) -> np.ndarray:
        """(G,) the indices of the whole global batch of ``step``, on every process."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.global_batch_size
        return self.epoch_order(epoch)[start : start + self.global_batch_size]

    def indices(self, step: int) -> np.ndarray:
        """(G/P,) this process's contiguous share of the global batch of ``step``."""
        share = self.global_batch_size // self.process_count
        lo = self.process_index * share
        return self.global_indices(step)[lo : lo + share]
