"""The training harness as plain functions (no flags): configuration, optimiser and steps, checkpoints, metrics,
devices, and the loop `train(config)` that ties them together."""

from deltajax.train.checkpoint import Checkpointer, CheckpointError
from deltajax.train.config import OptimConfig, TrainConfig
from deltajax.train.loop import NonFiniteLossError, evaluate, init_state, train
from deltajax.train.parallel import initialize_distributed, make_mesh
from deltajax.train.step import cross_entropy_sums, learning_rate_schedule, make_eval_step, make_optimizer, \
    make_train_step

__all__ = [
    "CheckpointError", "Checkpointer", "NonFiniteLossError", "OptimConfig", "TrainConfig", "cross_entropy_sums",
    "evaluate", "init_state", "initialize_distributed", "learning_rate_schedule", "make_eval_step", "make_mesh",
    "make_optimizer", "make_train_step", "train",
]
