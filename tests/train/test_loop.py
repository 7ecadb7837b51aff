"""The loop on one device: exact resume, NaN stop, refused checkpoints, accumulation, schedule, outputs."""

import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltajax.train import (CheckpointError, NonFiniteLossError, OptimConfig, learning_rate_schedule, train)
from deltajax.train.checkpoint import Checkpointer
from deltajax.train.metrics import read_records
from train_helpers import PoisonedSource, random_corpus, tiny_config


def _seed():
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return seed


def _saved_params(run_dir, step):
    directory = os.path.join(run_dir, "checkpoints", str(step), "state")
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(directory)["params"]


def test_resume_is_bitwise_identical(tmp_path):
    seed = _seed()
    data = random_corpus(seed)
    straight = train(tiny_config(tmp_path / "straight", seed=seed % 1000), data=data, log=lambda *_: None)
    train(tiny_config(tmp_path / "resumed", seed=seed % 1000), data=data, stop_after=3, log=lambda *_: None)
    assert Checkpointer(str(tmp_path / "resumed" / "checkpoints"), every=3, keep=5).all_steps() == [3]
    resumed = train(tiny_config(tmp_path / "resumed", seed=seed % 1000), data=data, log=lambda *_: None)
    a, b = _saved_params(str(tmp_path / "straight"), 6), _saved_params(str(tmp_path / "resumed"), 6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert straight["loss"] == resumed["loss"]
    losses = [r["loss"] for r in read_records(str(tmp_path / "resumed" / "metrics.jsonl")) if r["kind"] == "train"]
    assert len(losses) == 6  # the log of the first part is kept, nothing is duplicated
    assert os.path.exists(tmp_path / "resumed" / "loss.png")
    assert {"eval_perplexity@1x", "eval_perplexity@2x", "eval_bits_per_byte@2x"} <= set(straight)


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    data = random_corpus(_seed())
    # Batch of step 5 holds examples 16..19 of the shuffled order; poison the one at position 17.
    from deltajax.data import train_iterator

    iterator = train_iterator(data.train, 4, seed=0)
    order = [next(iterator) for _ in range(5)]
    bad = [i for i in range(len(data.train)) if np.array_equal(data.train[i]["inputs"], order[4]["inputs"][1])][0]
    data.train = PoisonedSource(data.train, bad)
    config = tiny_config(tmp_path, checkpoint_every=2, steps=8)
    with pytest.raises(NonFiniteLossError, match="step 5: the loss became nan.*last good checkpoint is step 4"):
        train(config, data=data, log=lambda *_: None)
    assert Checkpointer(str(tmp_path / "checkpoints"), every=2, keep=5).all_steps() == [2, 4]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(_saved_params(str(tmp_path), 4)))


def test_incompatible_and_corrupt_checkpoints_are_refused(tmp_path):
    data = random_corpus(_seed())
    train(tiny_config(tmp_path, steps=3), data=data, log=lambda *_: None)
    wider = tiny_config(tmp_path, steps=6)
    wider = wider.__class__(**{**wider.__dict__, "model": wider.model.replace(d_model=48)})
    with pytest.raises(CheckpointError, match=r"model\.d_model: checkpoint 32, now 48"):
        train(wider, data=data, log=lambda *_: None)
    with pytest.raises(CheckpointError, match="batch_size"):
        train(tiny_config(tmp_path, steps=6, batch_size=8), data=data, log=lambda *_: None)
    # Damage every array file of the saved state.
    for root, _, files in os.walk(tmp_path / "checkpoints" / "3" / "state"):
        for name in files:
            if "manifest" in name or name.endswith(("zarray", ".json")) or "ocdbt" in root:
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"garbage")
    with pytest.raises(CheckpointError, match="damaged or incomplete|cannot be read"):
        train(tiny_config(tmp_path, steps=6), data=data, log=lambda *_: None)


def test_gradient_accumulation_matches_one_batch(tmp_path):
    from deltajax.train.step import make_optimizer, make_train_step
    from deltajax.train import init_state, make_mesh

    config = tiny_config(tmp_path)
    data = random_corpus(_seed())
    optimizer, schedule = make_optimizer(config.optim, 10)
    mesh = make_mesh(1)
    graphdef, state = init_state(config.model, optimizer, 0, mesh)
    batch = {k: jnp.asarray(np.stack([data.train[i][k] for i in range(4)])) for k in data.train[0]}
    one = jax.jit(make_train_step(graphdef, optimizer, schedule, 1))(state, batch)
    two = jax.jit(make_train_step(graphdef, optimizer, schedule, 2))(state, batch)
    np.testing.assert_allclose(one[1]["loss"], two[1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(one[1]["grad_norm"], two[1]["grad_norm"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(one[0]["params"]), jax.tree.leaves(two[0]["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_schedule_warmup_then_cosine():
    schedule = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
    assert float(schedule(0)) == 0.0 and abs(float(schedule(5)) - 0.5) < 1e-6
    assert abs(float(schedule(10)) - 1.0) < 1e-6 and abs(float(schedule(60)) - 0.55) < 1e-6
    assert abs(float(schedule(110)) - 0.1) < 1e-6
