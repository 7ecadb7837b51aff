"""absl flags of the synthetic-task scripts (state_tracking.py, mqar.py): wall budgets, data workers and seed.

Defined by a call, not on import, so that a script that imports `_synthetic` for its helpers alone (lm_compare.py)
keeps its own flags of the same names.
"""

from absl import flags


def define_run_flags():
    flags.DEFINE_float("time_budget_s", None, "Wall seconds for all runs together (compilation and evaluation "
                       "included), split evenly; each run fits its schedule to at most --steps steps that fit its "
                       "share and stops at its deadline. Unset: exactly --steps steps.")
    flags.DEFINE_float("train_seconds", None, "Training wall seconds of every run, counted from the end of its "
                       "first (compiling) step, within its share of --time_budget_s (see experiments/_synthetic.py). "
                       "Unset: each run trains until its share's deadline.")
    flags.DEFINE_integer("data_workers", 0, "Processes building training batches (0: in the main process).")
    flags.DEFINE_integer("seed", 0, "Initialisation and data seed.")
