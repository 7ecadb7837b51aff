"""A tiny run configuration and small corpora for the training tests (compiles in seconds on CPU)."""

import dataclasses

import numpy as np

from deltajax.data import Data, PackedBytes
from deltajax.nn import PRESETS
from deltajax.train import OptimConfig, TrainConfig

TINY_MODEL = PRESETS["tiny-hybrid"].replace(
    vocab_size=257, d_model=32, n_layers=2, layer_pattern="GA", n_heads=2, head_dim=16, n_value_heads=2,
    value_head_dim=16, n_attn_heads=2, n_kv_heads=1, attn_head_dim=16, mlp_ratio=2.0, chunk_size=16,
    compute_dtype="float32")


def tiny_config(run_dir, **changes):
    base = TrainConfig(model=TINY_MODEL, optim=OptimConfig(learning_rate=3e-3, warmup_steps=2), seq_len=32,
                       batch_size=4, steps=6, log_every=1, eval_every=0, eval_batches=2, checkpoint_every=3,
                       keep_checkpoints=5, run_dir=str(run_dir), progress_bar=False)
    return dataclasses.replace(base, **changes)


def random_corpus(seed, documents=300, seq_len=32):
    rng = np.random.default_rng(seed)
    docs = [bytes(rng.integers(97, 123, rng.integers(5, 120)).astype(np.uint8)) for _ in range(documents)]
    train = PackedBytes(docs[:250], seq_len)
    validation = {m: PackedBytes(docs[250:], m * seq_len) for m in (1, 2)}
    return Data(train, validation, 257, True, "random letters")


class PoisonedSource:
    """Wraps a source so that example `bad_index` has a NaN weight (its batch's loss is NaN)."""

    def __init__(self, source, bad_index):
        self.source, self.bad_index = source, bad_index

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        x = dict(self.source[index])
        if index == self.bad_index:
            x["weights"] = np.full_like(x["weights"], np.nan)
        return x
