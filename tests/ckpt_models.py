"""A user model for the checkpoint tests: BatchNorm statistics and two dropout layers
in the state a checkpoint must carry."""

from __future__ import annotations

from flax import nnx


class BatchNormDropoutMLP(nnx.Module):
    """(B, in_features) -> (B, num_classes), with BatchNorm and two Dropout layers."""

    def __init__(self, config, rngs: nnx.Rngs):
        width = 32
        self.fc1 = nnx.Linear(config.in_features, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, momentum=0.8, rngs=rngs)
        self.drop1 = nnx.Dropout(0.2, rngs=rngs)
        self.fc2 = nnx.Linear(width, width, rngs=rngs)
        self.drop2 = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(width, config.num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.drop1(nnx.relu(self.bn(self.fc1(x))))
        return self.head(self.drop2(nnx.relu(self.fc2(x))))
