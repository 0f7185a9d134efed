"""Your own training loop with jaxdist's public API: a CNN with BatchNorm and Dropout.

Command:   python experiments/custom_loop.py [--strategy gspmd|shard_map|pmap]
           then: tensorboard --logdir runs/custom_loop
Hardware:  any; 8 CPU devices are emulated when run on a CPU.
Expected:  loss falls from about 1.4 to below 0.05 in 150 steps; held-out accuracy 1.000
           (the same with every strategy; about 6 s on a 2-core CPU).
"""

import argparse

import numpy as np
import optax
from flax import nnx

import jaxdist


class CNN(nnx.Module):  # (B, 16, 16, 1) images -> (B, 4) logits
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(2 * 2 * 8, 4, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn(self.conv(x))))  # (B, 16, 16, 8)
        x = x.reshape(-1, 2, 8, 2, 8, 8).mean(axis=(2, 4))  # quadrant means: (B, 2, 2, 8)
        return self.head(x.reshape(x.shape[0], -1))


def synthetic_images(step: int, rows: int):  # label k: a bright k-th quadrant
    rng = np.random.default_rng(step)
    y = rng.integers(0, 4, rows)
    x = rng.normal(size=(rows, 16, 16, 1)).astype(np.float32)
    for i, k in enumerate(y):
        x[i, (k // 2) * 8 : (k // 2) * 8 + 8, (k % 2) * 8 : (k % 2) * 8 + 8] += 1.5
    return {"x": x, "y": y.astype(np.int32)}


def loss_fn(model, batch, rngs):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def main(
    strategy: str, steps: int = 150, global_batch_size: int = 64, tb_dir: str | None = None
) -> float:
    info = jaxdist.initialize(cpu_devices=8)
    jaxdist.print_main(info)
    mesh = jaxdist.make_mesh()
    dp = jaxdist.DataParallel(
        CNN(nnx.Rngs(0)), optax.adam(3e-3), loss_fn, mesh=mesh, strategy=strategy
    )
    state = dp.init_state()
    rows = global_batch_size // info.process_count  # this process's share of each batch
    # TensorBoard in three lines (1/3); with several processes, give it on process 0 only
    sinks = jaxdist.sinks.Sinks([jaxdist.sinks.TensorBoard(tb_dir)] if tb_dir else [])
    for step in range(steps):
        batch = jaxdist.shard_batch(synthetic_images(step, rows), mesh)
        state, metrics = dp.step(state, batch)
        dp.check(metrics, step)  # a NaN loss or gradient raises, naming the parameter
        if step % 25 == 0 or step == steps - 1:
            values = dp.metrics(metrics)  # floats: loss, accuracy, grad_norm (lr: schedule=)
            sinks.log(step, values)  # (2/3)
            jaxdist.print_main(f"step {step:4d}  loss {values['loss']:.3f}")
    sinks.close()  # (3/3) flushes the files
    model = dp.merge(state)  # eval mode: running BatchNorm statistics, no dropout
    held_out = synthetic_images(10_000, 512)
    accuracy = float((model(held_out["x"]).argmax(-1) == held_out["y"]).mean())
    jaxdist.print_main(f"held-out accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="gspmd", choices=["gspmd", "shard_map", "pmap"])
    parser.add_argument("--tb-dir", default="runs/custom_loop/tb", help="TensorBoard's files")
    args = parser.parse_args()
    main(args.strategy, tb_dir=args.tb_dir)
