import os
import sys
import warnings

# Shared test helpers (tests/testing_utils.py) importable from every test folder.
sys.path.insert(0, os.path.dirname(__file__))

warnings.filterwarnings("ignore", message=".*pallas.*triton.*", category=DeprecationWarning)

# Computations on the CPU run inline rather than dispatched asynchronously. The Pallas TPU interpreter runs its
# kernels' memory operations as io_callbacks that themselves execute JAX operations; with asynchronous dispatch an
# eager test could issue its next operation while such a kernel was still running, and a CI run hung there (both
# threads waiting in `apply_primitive`, tests/kernels/test_tpu_chunk.py, 2026-11-23). Read when the CPU client is
# created, so it is set before any test runs a computation.
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)
