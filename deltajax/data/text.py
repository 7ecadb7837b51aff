"""Byte-level language modelling from corpora on disk, packed into fixed-length sequences with `segment_ids`.

A corpus is a list of documents (bytes). Every document is written as [BOS] + its UTF-8 bytes and all documents
are concatenated into one stream of token ids (bytes 0..255, BOS = 256). Example i is the window
stream[i T : i T + T + 1]: inputs are its first T tokens, targets the last T, `segment_ids` number the documents
inside the window from 1, and a target is scored only when it belongs to the same document as its input, so no
prediction crosses a document boundary (and every scored target is a byte: loss / ln 2 is bits per byte).

Readers: plain text (any file: one document per file), `.jsonl` (one document per line, field `text_field`),
`.parquet` (column `text_field`; needs pyarrow). A directory is read recursively (files ending in .txt, .md,
.rst, .py, .jsonl, .parquet). The default corpus is the Python standard library's own source files, present
wherever Python is installed.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sysconfig
import zlib
from typing import Sequence

import numpy as np

BYTE_VOCAB = 256
BOS = 256
VOCAB_SIZE = 257
DIRECTORY_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".parquet")
DEFAULT_CORPUS = "python-stdlib"


def _read_jsonl(path, text_field):
    documents = []
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not valid JSON: {error}") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{line_number} has no field {text_field!r} (set --text_field)")
            documents.append(str(record[text_field]).encode("utf-8"))
    return documents


def _read_parquet(path, text_field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                          f"(or convert the corpus to .jsonl / text files)") from None
    table = pq.read_table(path, columns=[text_field])
    return [str(x).encode("utf-8") for x in table.column(text_field).to_pylist() if x is not None]


def _read_file(path, text_field):
    if path.endswith(".jsonl"):
        return _read_jsonl(path, text_field)
    if path.endswith(".parquet"):
        return _read_parquet(path, text_field)
    with open(path, "rb") as f:
        return [f.read()]


def _expand(path: str) -> list[str]:
    if os.path.isdir(path):
        found = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            found += [os.path.join(root, name) for name in sorted(files) if name.endswith(DIRECTORY_SUFFIXES)]
        return found
    if os.path.isfile(path):
        return [path]
    matches = sorted(glob.glob(path, recursive=True))
    if not matches:
        raise FileNotFoundError(f"no corpus file matches {path!r}")
    return [m for m in matches if os.path.isfile(m)]


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[bytes]:
    """Documents (bytes) from files, directories and globs, in a deterministic order; empty ones dropped."""
    files = [f for p in paths for f in _expand(p)]
    if not files:
        raise FileNotFoundError(f"no corpus files found in {list(paths)} (directories are searched for "
                                f"{', '.join(DIRECTORY_SUFFIXES)})")
    documents = [d for f in files for d in _read_file(f, text_field)]
    documents = [d for d in documents if d]
    if not documents:
        raise ValueError(f"the corpus {list(paths)} has no non-empty documents")
    return documents


def default_corpus_files() -> list[str]:
    """The standard library's .py files (tests, site-packages and IDLE left out), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
    if len(files) < 50:
        raise FileNotFoundError(f"the Python standard library sources were not found under {root} (found "
                                f"{len(files)} .py files); pass --data=PATH to train on your own corpus")
    return files


def split_documents(documents: list[bytes], validation_fraction: float):
    """(train, validation) documents: documents are assigned by a hash of their bytes when there are enough of
    them, otherwise the last `validation_fraction` of every document is held out."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    buckets = 10_000
    held = [zlib.crc32(d) % buckets < validation_fraction * buckets for d in documents]
    train = [d for d, h in zip(documents, held) if not h]
    validation = [d for d, h in zip(documents, held) if h]
    if len(documents) >= 2 / validation_fraction and train and validation:
        return train, validation
    cut = [int(len(d) * (1 - validation_fraction)) for d in documents]
    return ([d[:c] for d, c in zip(documents, cut) if c > 0],
            [d[c:] for d, c in zip(documents, cut) if c < len(d)])


@dataclasses.dataclass
class PackedBytes:
    """Random-access source of packed byte windows (see the module docstring). `len` = (stream - 1) // T."""

    documents: list[bytes]
    seq_len: int
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self):
        lengths = np.array([len(d) + 1 for d in self.documents], np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        stream = np.empty(int(lengths.sum()), np.uint16)
        for start, document in zip(self.doc_starts, self.documents):
            stream[start] = BOS
            stream[start + 1:start + 1 + len(document)] = np.frombuffer(document, np.uint8)
        self.stream = stream
        self.num_bytes = int(lengths.sum() - len(self.documents))
        if len(self) < 1:
            raise ValueError(f"the corpus ({len(stream)} tokens) is shorter than one sequence of "
                             f"{self.seq_len + 1} tokens")

    def __len__(self):
        return (len(self.stream) - 1) // self.seq_len

    def __getitem__(self, index):
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        begin = index * self.seq_len
        window = self.stream[begin:begin + self.seq_len + 1].astype(np.int32)
        doc = np.searchsorted(self.doc_starts, np.arange(begin, begin + self.seq_len + 1), side="right")
        segment = (doc - doc[0] + 1).astype(np.int32)
        return dict(inputs=window[:-1], targets=window[1:], segment_ids=segment[:-1],
                    weights=(segment[1:] == segment[:-1]).astype(np.float32))

    def __repr__(self):
        return (f"PackedBytes({len(self.documents)} documents, {self.num_bytes} bytes, seq_len={self.seq_len}, "
                f"{len(self)} windows)")
