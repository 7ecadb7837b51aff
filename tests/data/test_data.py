"""Synthetic tasks, packed bytes and the grain iterators."""

import json
import secrets

import numpy as np
import pytest

from deltajax.data import (BOS, MQAR, DataConfig, MQARMixture, ModularArithmetic, PackedBytes, Parity, build_data,
                           eval_batches, read_documents, split_documents, train_iterator)


def _seed():
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return seed


def test_mqar_definition():
    source = MQAR(seq_len=128, vocab_size=64, num_kv_pairs=8, seed=_seed())
    for index in np.random.default_rng(0).integers(0, 10**9, 20):
        x = source[index]
        seq = np.concatenate([x["inputs"], x["targets"][-1:]])
        keys, values = seq[0:16:2], seq[1:16:2]
        assert len(set(keys)) == 8 and keys.max() < 32 and values.min() >= 32
        scored = np.flatnonzero(x["weights"])
        assert len(scored) == 8 and scored.min() >= 16
        lookup = dict(zip(keys, values))
        assert sorted(x["inputs"][scored]) == sorted(keys)
        assert all(x["targets"][t] == lookup[x["inputs"][t]] for t in scored)
        np.testing.assert_array_equal(source[index]["inputs"], x["inputs"])  # a pure function of the index


def test_mqar_queries_follow_a_power_law():
    source = MQAR(seq_len=512, vocab_size=256, num_kv_pairs=4, seed=_seed())
    slots = np.concatenate([(np.flatnonzero(source[i]["weights"]) - 8) // 2 for i in range(300)])
    # Uniform placement would put the median slot near the middle (~126 of 252 slots).
    assert np.median(slots) < 60


def test_mqar_mixture_draws_every_setting_at_one_padded_length():
    settings = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))
    source = MQARMixture(settings, vocab_size=8192, seed=_seed())
    assert source.seq_len == source.padded_len == 256
    drawn = {}
    for index in np.random.default_rng(1).integers(0, 10**12, 400):
        x = source[index]
        seq_len, pairs = source.setting(index)
        drawn[(seq_len, pairs)] = drawn.get((seq_len, pairs), 0) + 1
        assert all(x[k].shape == (256,) for k in ("inputs", "targets", "weights", "segment_ids"))
        # The example proper: its pairs at the front, each query scored with the value it was given.
        seq = np.concatenate([x["inputs"][:seq_len], x["targets"][seq_len - 1:seq_len]])
        keys, values = seq[0:2 * pairs:2], seq[1:2 * pairs:2]
        assert len(set(keys)) == pairs and keys.max() < 4096 and values.min() >= 4096
        scored = np.flatnonzero(x["weights"])
        assert len(scored) == pairs and 2 * pairs <= scored.min() and scored.max() < seq_len
        lookup = dict(zip(keys, values))
        assert all(x["targets"][t] == lookup[x["inputs"][t]] for t in scored)
        # The padding: unscored random filler in a segment of its own, never a run of zeros.
        assert (x["segment_ids"][:seq_len] == 1).all() and (x["segment_ids"][seq_len:] == 2).all()
        if seq_len < 256:
            filler = x["inputs"][seq_len:]
            assert not x["weights"][seq_len:].any() and len(np.unique(filler)) > len(filler) // 2
        np.testing.assert_array_equal(source[index]["inputs"], x["inputs"])  # a pure function of the index
    # Every setting drawn, each about equally often (400 draws, 80 expected each).
    assert set(drawn) == set(settings) and min(drawn.values()) > 40


def test_mqar_mixture_draws_fresh_examples():
    source = MQARMixture(((32, 4), (64, 8)), vocab_size=64, seed=_seed())
    rows = [tuple(source[i]["inputs"]) for i in range(200)]
    assert len(set(rows)) == 200  # no repeats
    other = MQARMixture(((32, 4), (64, 8)), vocab_size=64, seed=source.seed + 1)
    assert any(tuple(other[i]["inputs"]) != rows[i] for i in range(20))
    # Its streams are apart from the plain source of the same seed (e.g. a test set).
    plain = MQAR(64, vocab_size=64, num_kv_pairs=8, seed=source.seed + 1)
    assert all(tuple(plain[i]["inputs"]) != rows[i] for i in range(200))
    with pytest.raises(ValueError):
        MQARMixture(((64, 20),), vocab_size=64)  # 20 pairs do not fit in 64 tokens
    with pytest.raises(ValueError):
        MQARMixture(((64, 4),), vocab_size=64, padded_len=32)


def test_parity_targets():
    x = Parity(seq_len=100, seed=_seed())[7]
    np.testing.assert_array_equal(x["targets"], np.cumsum(x["inputs"]) % 2)
    assert x["weights"].sum() == 100


@pytest.mark.parametrize("brackets", [False, True])
def test_modular_arithmetic_matches_python(brackets):
    source = ModularArithmetic(seq_len=40, modulus=5, brackets=brackets, seed=_seed())
    names = {v: k for k, v in source.tokens.items()}
    saw_operator = saw_bracket = False
    for i in range(200):
        x = source[i]
        equals = int(np.flatnonzero(x["weights"])[0])
        assert x["inputs"][equals] == source.tokens["="]
        text = "".join(str(t) if t < 5 else names[t] for t in x["inputs"][:equals])
        saw_operator |= "*" in text and ("+" in text or "-" in text)
        saw_bracket |= "(" in text
        assert x["targets"][equals] == eval(text) % 5, text
    assert saw_operator and saw_bracket == brackets


def test_packed_bytes_never_cross_documents():
    rng = np.random.default_rng(_seed())
    documents = [bytes(rng.integers(0, 256, rng.integers(1, 40)).astype(np.uint8)) for _ in range(50)]
    source = PackedBytes(documents, seq_len=16)
    stream = np.concatenate([np.concatenate([[BOS], np.frombuffer(d, np.uint8)]) for d in documents])
    scored = []
    for i in range(len(source)):
        x = source[i]
        np.testing.assert_array_equal(x["inputs"], stream[i * 16:i * 16 + 16])
        np.testing.assert_array_equal(x["targets"], stream[i * 16 + 1:i * 16 + 17])
        # A target is scored iff it is not the BOS of the next document; segments start at 1 and go up by one.
        np.testing.assert_array_equal(x["weights"], x["targets"] != BOS)
        assert x["segment_ids"][0] == 1 and set(np.diff(x["segment_ids"])) <= {0, 1}
        np.testing.assert_array_equal(np.diff(x["segment_ids"]) == 1, x["inputs"][1:] == BOS)
        scored += list(x["targets"][x["weights"] > 0])
    covered = stream[1:16 * len(source) + 1]
    np.testing.assert_array_equal(scored, covered[covered != BOS])  # every byte predicted once, in order


def test_readers(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    (tmp_path / "skip.bin").write_bytes(b"\x00")
    assert read_documents([str(tmp_path)]) == [b"first document", b"second", b"third"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'"):
        read_documents([str(tmp_path / "bad.jsonl")])
    with pytest.raises(FileNotFoundError):
        read_documents([str(tmp_path / "missing*.txt")])
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pyarrow"):
            read_documents([str(tmp_path / "c.parquet")])


def test_split_is_disjoint_and_covers():
    documents = [f"document {i} ".encode() * (i % 7 + 1) for i in range(1000)]
    train, validation = split_documents(documents, 0.05)
    assert 10 < len(validation) < 120 and len(train) + len(validation) == 1000
    train, validation = split_documents([b"x" * 1000], 0.1)  # one document: its tail is held out
    assert train == [b"x" * 900] and validation == [b"x" * 100]


def test_default_corpus_and_resumable_sharded_iteration():
    data = build_data(DataConfig(), seq_len=64)
    assert data.is_bytes and data.vocab_size == 257 and len(data.train) > 10_000
    seed = _seed()
    reference = train_iterator(data.train, 8, seed=seed)
    batches = [next(reference) for _ in range(5)]
    resumed = train_iterator(data.train, 8, seed=seed)
    for _ in range(2):
        next(resumed)
    resumed = train_iterator(data.train, 8, seed=seed, state=resumed.get_state())
    for expected in batches[2:]:
        np.testing.assert_array_equal(next(resumed)["inputs"], expected["inputs"])
    # Two processes each read half of every global batch, in order.
    halves = [train_iterator(data.train, 8, seed=seed, process_index=p, process_count=2) for p in range(2)]
    for expected in batches:
        np.testing.assert_array_equal(np.concatenate([next(h)["inputs"] for h in halves]), expected["inputs"])
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
    validation = eval_batches(data.validation[2], 4, 3)
    assert len(validation) == 3 and validation[0]["inputs"].shape == (4, 128)
