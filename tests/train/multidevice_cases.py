"""Checks that need 8 CPU devices; run as `python multidevice_cases.py CASE` in a fresh process (the device count
is fixed when jax starts). Every check asserts; a failure exits non-zero with the message."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import deltajax  # noqa: E402
from deltajax.rules import sequence_parallel  # noqa: E402
from testing_utils import fresh_key, relative_error, rule_inputs  # noqa: E402

TOL = 1e-5  # fp32, as the rules' own chunk-vs-scan tests
GRAD_TOL = 1e-4


def _mesh(data, seq):
    return Mesh(np.array(jax.devices()[:data * seq]).reshape(data, seq), ("data", "seq"))


def case_rules():
    """Sequence-parallel delta rule / linear attention vs the single-device rule: outputs, final state, gradients."""
    grid = [("delta_rule", "scalar", 128, True, (2, 4)), ("delta_rule", "channel", 203, True, (1, 8)),
            ("delta_rule", "none", 100, False, (1, 4)), ("linear_attention", "scalar", 96, True, (2, 4))]
    for op, decay, T, packed, shape in grid:
        x = rule_inputs(fresh_key(), B=2, T=T, decay=decay, packed=packed, with_initial_state=True, beta_max=2.0)
        if packed:
            # Documents that start exactly at slice boundaries as well as inside slices.
            seg = np.asarray(x["segment_ids"]).copy()
            for boundary in range(T // shape[1], T, T // shape[1] * 2):
                seg[0, boundary:] += 1
            x["segment_ids"] = jnp.asarray(seg)
        mesh = _mesh(*shape)
        names = ["q", "k", "v", "log_decay", "initial_state"] + (["beta"] if op == "delta_rule" else [])
        names = [n for n in names if x[n] is not None]
        co_o = jax.random.normal(fresh_key(), x["v"].shape)
        co_s = jax.random.normal(fresh_key(), x["initial_state"].shape)

        def run(d, parallel):
            beta = (d["beta"],) if op == "delta_rule" else ()
            fn = getattr(sequence_parallel if parallel else deltajax, op)
            kw = dict(mesh=mesh, batch_axis="data" if shape[0] > 1 else None) if parallel else dict(impl="scan")
            return fn(d["q"], d["k"], d["v"], *beta, d.get("log_decay"), initial_state=d["initial_state"],
                      segment_ids=x["segment_ids"], chunk_size=16, **kw)

        loss = lambda d, parallel: sum(jnp.sum(a * c) for a, c in zip(run(d, parallel), (co_o, co_s)))
        diff = {n: x[n] for n in names}
        (o_ref, s_ref), (o, s) = run(diff, False), jax.jit(lambda d: run(d, True))(diff)
        assert relative_error(o, o_ref) <= TOL, (op, decay, relative_error(o, o_ref))
        assert relative_error(s, s_ref) <= TOL, (op, decay, relative_error(s, s_ref))
        g_ref = jax.jit(jax.grad(lambda d: loss(d, False)))(diff)
        g = jax.jit(jax.grad(lambda d: loss(d, True)))(diff)
        for n in names:
            assert relative_error(g[n], g_ref[n]) <= GRAD_TOL, (op, decay, n, relative_error(g[n], g_ref[n]))
        print(op, decay, T, shape, "ok")
    # Inside a `use_sequence_parallel` context the named rules shard without a mesh argument.
    x = rule_inputs(fresh_key(), B=2, T=64, decay="scalar")
    with sequence_parallel.use_sequence_parallel(_mesh(1, 8)):
        o, _ = jax.jit(lambda x: sequence_parallel.gated_deltanet(x["q"], x["k"], x["v"], x["beta"],
                                                                  x["log_decay"], chunk_size=8))(x)
    o_ref, _ = deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], impl="scan")
    assert relative_error(o, o_ref) <= TOL


def case_train_step():
    """Loss and gradients of one train step on (data, seq) meshes equal those on one device."""
    from deltajax.train import init_state, make_mesh  # noqa: F401
    from deltajax.train.loop import with_mesh
    from deltajax.train.parallel import batch_sharding
    from deltajax.train.step import loss_sums, make_optimizer
    from train_helpers import TINY_MODEL, random_corpus

    model = TINY_MODEL.replace(layer_pattern="GA")
    optimizer, _ = make_optimizer(tiny_optim(), 10)
    data = random_corpus(int(fresh_key()[1]) % 10**6, seq_len=64)
    batch = {k: np.stack([data.train[i][k] for i in range(8)]) for k in data.train[0]}

    def loss_and_grads(shape):
        mesh = _mesh(*shape)
        graphdef, state = init_state(model, optimizer, 0, mesh)
        sharded = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}

        def fn(params, rest, b):
            (total, count), grads = jax.value_and_grad(
                lambda p: loss_sums(graphdef, p, rest, b), has_aux=True)(params)
            return total / count, jax.tree.map(lambda g: g / count, grads)

        return jax.jit(with_mesh(fn, mesh))(state["params"], state["rest"], sharded)

    loss_ref, grads_ref = loss_and_grads((1, 1))
    for shape in [(8, 1), (2, 4), (1, 8)]:
        loss, grads = loss_and_grads(shape)
        assert abs(float(loss) - float(loss_ref)) <= 1e-6 * abs(float(loss_ref)), (shape, loss, loss_ref)
        error = relative_error(jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)]),
                               jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads_ref)]))
        assert error <= GRAD_TOL, (shape, error)
        print(shape, float(loss), error, "ok")


def tiny_optim():
    from deltajax.train import OptimConfig

    return OptimConfig()


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    globals()[f"case_{sys.argv[1]}"]()
    print("passed")
