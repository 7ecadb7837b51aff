"""From a data description to grain iterators: train (shuffled, repeated, resumable) and evaluation batches.

Batches are dicts of numpy arrays [local_batch, T] (`inputs`, `targets`, `weights`, `segment_ids`). With P
processes each process reads local_batch = global_batch / P rows: global batch s is examples
[s B, (s + 1) B) of the shuffled stream, process p holding rows [p B / P, (p + 1) B / P) of it, so the global batch
is the same whatever the number of processes. The train iterator's position is `iterator.get_state()` (a small
dict, saved in checkpoints) and `iterator.set_state(...)` resumes it exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import grain

from deltajax.data import synthetic, text

TASKS = ("bytes", "mqar", "parity", "modular", "modular_brackets")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to train on. `paths` (bytes only): files, directories or globs; empty means the default corpus."""

    task: str = "bytes"
    paths: tuple = ()
    text_field: str = "text"
    validation_fraction: float = 0.01
    mqar_vocab_size: int = 8192
    mqar_num_kv_pairs: int = 16
    modulus: int = 5
    seed: int = 0

    def validate(self) -> "DataConfig":
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.paths and self.task != "bytes":
            raise ValueError(f"paths are only read by the bytes task, not {self.task!r}")
        return self


@dataclasses.dataclass
class Data:
    """The sources of one run: `train` at the training length, `validation` keyed by length multiple (1, 2)."""

    train: object
    validation: dict
    vocab_size: int
    is_bytes: bool  # loss / ln 2 is bits per byte
    description: str


def _task_source(config: DataConfig, seq_len: int, seed: int):
    if config.task == "mqar":
        return synthetic.MQAR(seq_len, vocab_size=config.mqar_vocab_size, num_kv_pairs=config.mqar_num_kv_pairs,
                              seed=seed)
    if config.task == "parity":
        return synthetic.Parity(seq_len, seed=seed)
    return synthetic.ModularArithmetic(seq_len, modulus=config.modulus,
                                       brackets=config.task == "modular_brackets", seed=seed)


def build_data(config: DataConfig, seq_len: int, eval_multiples=(1, 2)) -> Data:
    """Train and validation sources for sequences of `seq_len` (validation also at each multiple of it)."""
    config.validate()
    if config.task == "bytes":
        if config.paths:
            documents, name = text.read_documents(config.paths, config.text_field), ", ".join(config.paths)
        else:
            documents = text.read_documents(text.default_corpus_files())
            name = f"{text.DEFAULT_CORPUS} ({len(documents)} files)"
        train_docs, validation_docs = text.split_documents(documents, config.validation_fraction)
        train = text.PackedBytes(train_docs, seq_len)
        validation = {m: text.PackedBytes(validation_docs, m * seq_len) for m in eval_multiples}
        description = (f"bytes from {name}: {train.num_bytes:,} train bytes, "
                       f"{validation[eval_multiples[0]].num_bytes:,} validation bytes")
        return Data(train, validation, text.VOCAB_SIZE, True, description)
    # Validation examples come from a different seed stream than training examples.
    train = _task_source(config, seq_len, seed=2 * config.seed)
    validation = {m: _task_source(config, m * seq_len, seed=2 * config.seed + 1) for m in eval_multiples}
    return Data(train, validation, train.vocab_size, False, repr(train))


def _check_batch(global_batch, process_count):
    if global_batch % process_count:
        raise ValueError(f"the global batch ({global_batch}) must divide by the number of processes "
                         f"({process_count})")


def train_iterator(source, global_batch: int, *, seed: int, process_index: int = 0, process_count: int = 1,
                   state: Optional[dict] = None):
    """An endless, shuffled (re-shuffled every epoch) iterator of this process's rows of every global batch."""
    _check_batch(global_batch, process_count)
    dataset = grain.MapDataset.source(source)
    if len(source) < synthetic.NUM_EXAMPLES:  # synthetic examples are already independent draws
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(None).batch(global_batch // process_count, drop_remainder=True)
    iterator = iter(dataset[process_index::process_count])
    if state is not None:
        iterator.set_state(state)
    return iterator


def eval_batches(source, global_batch: int, num_batches: int, *, process_index: int = 0, process_count: int = 1):
    """The first `num_batches` global batches of `source` in order (fewer if the source is shorter); a list."""
    _check_batch(global_batch, process_count)
    available = len(source) // global_batch
    if available < 1:
        raise ValueError(f"the validation set ({len(source)} sequences of {getattr(source, 'seq_len', '?')} "
                         f"tokens) is smaller than one batch of {global_batch}: lower --eval_batch_size or use a "
                         f"larger corpus / --validation_fraction")
    dataset = grain.MapDataset.source(source).batch(global_batch // process_count, drop_remainder=True)
    dataset = dataset[process_index::process_count]
    return [dataset[i] for i in range(min(num_batches, available))]
