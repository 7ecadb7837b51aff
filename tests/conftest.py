import atexit
import os
import shutil
import sys
import tempfile
import warnings

# Shared test helpers (tests/testing_utils.py) importable from every test folder.
sys.path.insert(0, os.path.dirname(__file__))

# Failing tests' reports written as they arrive when DELTAJAX_FAILURE_LOG names a file (tests/failure_log.py): a
# device call cut off by its time limit keeps the reasons.
from failure_log import pytest_runtest_logreport  # noqa: E402, F401

warnings.filterwarnings("ignore", message=".*pallas.*triton.*", category=DeprecationWarning)

# Most of a CPU test's time is XLA compiling, not running: interpret-mode Pallas kernels lower to large HLO
# modules (one kernel test: 18 compiles, 48 of its 64 s in the backend compiler). LLVM at optimisation level 0
# compiles them faster and runs them slower, which these small inputs do not notice (that test 64 -> 38 s, an MQAR
# smoke run 169 -> 120 s; 2-core CPU machine, 2026-12-02). Subprocesses inherit it. Left alone beside an
# accelerator, whose compiled kernels are what the GPU and TPU tests measure.
_ACCELERATOR_DEVICES = ("/dev/nvidiactl", "/dev/accel0", "/dev/vfio")
CPU_ONLY = not any(os.path.exists(d) for d in _ACCELERATOR_DEVICES)
if CPU_ONLY:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# XLA's CPU runtime runs parts of each program on an intra-op thread pool of one thread per core, or of PJRT_NPROC
# threads, read when the CPU client is created. The Mosaic GPU interpreter runs each warpgroup of a CTA as its own
# program, and a warpgroup blocked in a barrier wait holds the pool thread it runs on: on a 2-core machine the grid
# loop's callback and one blocked warpgroup took both threads while the other warpgroup's program waited for one,
# and a two-warpgroup kernel's interpreter tests hung (docs/kernels.md, "KDA: a producer warpgroup per state block").
# Four threads leave one free (the callback and one per warpgroup; tests/kernels/test_mosaic_kda.py reads the count).
if CPU_ONLY:
    os.environ.setdefault("PJRT_NPROC", str(max(4, os.cpu_count() or 1)))

import jax  # noqa: E402

# Computations on the CPU run inline rather than dispatched asynchronously. The Pallas TPU interpreter runs its
# kernels' memory operations as io_callbacks that themselves execute JAX operations; with asynchronous dispatch an
# eager test could issue its next operation while such a kernel was still running, and a CI run hung there (both
# threads waiting in `apply_primitive`, tests/kernels/test_tpu_chunk.py, 2026-11-23). Read when the CPU client is
# created, so it is set before any test runs a computation.
jax.config.update("jax_cpu_enable_async_dispatch", False)

# The tests jit a fresh closure per call, so a program they build again (the scan reference on every draw of a
# family, a kernel configuration under several families) is traced again and would be compiled again: a persistent
# compilation cache, keyed on the lowered program and the compile options, serves the repeats (four adversarial
# kernel tests 160 -> 126 s, the repeats 39 -> 18 s each; 2026-12-02). One new directory per process (each xdist
# worker its own: no two processes write one entry), removed at exit; subprocesses do not use it.
if CPU_ONLY:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="deltajax-test-xla-cache-")
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
