"""Orbax checkpoints of a run: the train state, the data iterator's position and the run's configuration.

One checkpoint per saved step, `<run_dir>/checkpoints/<step>/{state, data, config}`; the last `keep` are kept and
writes are asynchronous (the loop goes on while the arrays are written; `wait()` blocks until they are committed).
With several processes every process takes part and orbax writes each array once.

Resuming never silently starts from scratch: a checkpoint that cannot be read, or that was written by a run with
a different model, data, sequence length, batch size or seed, raises `CheckpointError` naming the difference.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

ITEMS = ("state", "data", "config")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be resumed from."""


def _differences(saved, current, prefix=""):
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in sorted(set(saved) | set(current)):
            found += _differences(saved.get(key, "<missing>"), current.get(key, "<missing>"),
                                  f"{prefix}{key}.")
        return found
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        saved, current = list(saved), list(current)
    return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r}, now {current!r}"]


class Checkpointer:
    """Saves every `every` steps (and when forced), keeps the last `keep`."""

    def __init__(self, directory: str, *, every: int, keep: int, asynchronous: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=asynchronous,
            create=True)
        self.every = every
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self):
        return self.manager.latest_step()

    def all_steps(self):
        return list(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, data_state: dict, identity: dict, config: dict):
        """Starts writing checkpoint `step` (asynchronously); returns at once."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave({"identity": identity, "config": config}))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state, identity: dict):
        """(state, data_state) of checkpoint `step`; `abstract_state` gives shapes, dtypes and shardings."""
        path = os.path.join(self.directory, str(step))
        try:
            saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception as error:  # orbax raises many kinds; all mean the same to the user
            raise CheckpointError(f"the checkpoint {path} cannot be read ({type(error).__name__}: {error}). "
                                  f"Delete it (or the run directory) to start again, or point --run_dir "
                                  f"elsewhere.") from error
        differences = _differences(saved.get("identity", {}), identity)
        if differences:
            raise CheckpointError(
                f"the checkpoint {path} belongs to a different run and cannot be resumed with this "
                f"configuration:\n  " + "\n  ".join(differences) +
                "\nUse the original settings, or another --run_dir to start a new run.")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as error:
            raise CheckpointError(f"the checkpoint {path} is damaged or incomplete ({type(error).__name__}: "
                                  f"{error}). Delete this step directory to resume from an earlier one.") from error
        return restored["state"], restored["data"]

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state):
    """ShapeDtypeStructs (with shardings) of a state, the restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
