"""deltajax: the delta-rule family of linear attention in JAX."""

from deltajax import rules
from deltajax.rules import (
    delta_rule,
    deltanet,
    efla,
    gated_deltanet,
    kaczmarz,
    kda,
    linear_attention,
    longhorn,
    relaxed_kaczmarz,
)

# Kernels register themselves with the rules' dispatch on import (rules never import kernels).
from deltajax import kernels as _kernels  # noqa: E402,F401

__version__ = "0.1.0"
