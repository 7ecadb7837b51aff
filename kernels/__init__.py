"""Pallas kernels behind the rules' signatures.

Importing this package (which `import deltajax` does) registers every kernel with `deltajax.rules.dispatch`
together with its `supports(...)` predicate; the rules never import kernels.
"""

from deltajax.kernels import gpu as gpu  # noqa: F401  (registers the Triton-backend GPU kernels)
from deltajax.kernels import tpu as tpu  # noqa: F401  (registers the Mosaic TPU kernels)
