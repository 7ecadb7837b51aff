"""The configuration of one training run: model, data, optimiser, loop and parallelism. Plain frozen dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Optional

from deltajax.data import DataConfig
from deltajax.nn import ModelConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup to `learning_rate`, cosine decay to `min_lr_ratio * learning_rate`, global-norm
    gradient clipping. Weight decay applies to matrices (ndim >= 2) only."""

    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    seq_len: int = 256
    batch_size: int = 16  # global, over all devices and processes
    grad_accum_steps: int = 1  # the batch is split into this many micro-batches, one update per step
    steps: int = 300
    log_every: int = 10
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8
    eval_multiples: tuple = (1, 2)  # evaluate at these multiples of seq_len
    checkpoint_every: int = 100  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    run_dir: str = "runs/default"
    seed: int = 0
    sequence_parallel: int = 1  # devices along the sequence axis; the rest form the data axis
    peak_flops: Optional[float] = None  # per device, for MFU; None: looked up from the device kind
    progress_bar: bool = True

    def validate(self) -> "TrainConfig":
        self.model.validate()
        self.data.validate()
        positive = ("seq_len", "batch_size", "grad_accum_steps", "steps", "log_every", "eval_batches",
                    "keep_checkpoints", "sequence_parallel")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"batch_size ({self.batch_size}) must divide by grad_accum_steps "
                             f"({self.grad_accum_steps})")
        o = self.optim
        if not o.learning_rate > 0 or o.warmup_steps < 0 or not 0 <= o.min_lr_ratio <= 1 or o.grad_clip < 0:
            raise ValueError(f"bad optimiser settings: {o}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def identity(self) -> dict:
        """What a checkpoint must match to be resumed by this config: the model, the data and its order."""
        d = self.to_dict()
        return {"model": d["model"], "data": d["data"], "seq_len": self.seq_len, "batch_size": self.batch_size,
                "seed": self.seed}
