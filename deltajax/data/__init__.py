"""grain sources and transforms: synthetic tasks (MQAR, parity, modular arithmetic) and packed byte-level text.

`build_data(DataConfig(...), seq_len)` gives the train and validation sources of a run; `train_iterator` and
`eval_batches` turn them into batches of `inputs`, `targets`, `weights` and `segment_ids`.
"""

from deltajax.data.pipeline import TASKS, Data, DataConfig, build_data, eval_batches, train_iterator
from deltajax.data.synthetic import MQAR, MQARMixture, ModularArithmetic, Parity
from deltajax.data.text import BOS, VOCAB_SIZE, PackedBytes, default_corpus_files, read_documents, split_documents

__all__ = [
    "BOS", "Data", "DataConfig", "MQAR", "MQARMixture", "ModularArithmetic", "PackedBytes", "Parity", "TASKS", "VOCAB_SIZE",
    "build_data", "default_corpus_files", "eval_batches", "read_documents", "split_documents", "train_iterator",
]
