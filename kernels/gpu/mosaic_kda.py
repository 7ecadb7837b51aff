"""The sequential passes of KDA (per-key-channel decay) as Mosaic GPU kernels: the forward pass (`forward_pass`,
`kda.Config.pass_backend="mosaic"`) and the reverse pass (`reverse_pass`, `kda.Config.reverse_backend="mosaic"`;
`_reverse_step` lists its products).

The forward pass replaces `kda._forward_kernel` (the Triton pass) and reads what that pass reads: the chunk operands
stored by `kda._gates_kernel` (A (.) Q, A (.) K and E (.) K as bf16 parts, gamma), v, beta, and T and P, here as
bf16 (hi, lo) pairs. Per chunk and state block S (K x BV, fp32 registers), equations (4)-(6) of `kda`:

    y   = V - (A.K) bf16(S)                       1 wgmma  (C x BV x K; plain bf16 state product)
    u   = T diag(beta) y                          3 wgmmas (C x BV x C; T and diag(beta) y as pairs)
    O   = scale [(A.Q) S + P u]                   6 wgmmas (the output's state product "split" as the Triton pass's
                                                            `Config.output_dots`, or 1 wgmma with "bf16"; P u split)
    S'  = Diag(gamma) S + (E.K)^T u               3 wgmmas (K x BV x C; E.K and u as pairs)

the products the Triton pass takes with the same operand roundings (`kda._pseudo_values`, `_odot`), so the two
agree to the fp32 summation order. Differentiated, the pass also writes every chunk's start state (bf16(S), the
tile the first product reads) and u's bf16 pair, as the Triton pass does with `Config.state_storage="bf16"` and
`Config.grads_from_passes`; the backward's other kernels are Triton's.

Three layouts. `_body`: one warpgroup per CTA, grid (V/BV, B*Hv); CTA (j, bh) owns the state block
S[:, BV j : BV (j+1)] of value head bh and walks the chunks in order, the inputs streaming through
`plgpu.emit_pipeline` (TMA). SMEM at BV = 64: one pipeline stage of 5 C x K operand tiles, the T and P pairs, v and
the vectors (120.8 KiB), S's pair, the operand pairs of diag(beta) y and u and the output tile (72 KiB): 193 KiB,
so one stage (two would ask 314 KiB). `_body_producer` (its docstring): a producer warpgroup that releases each
input as soon as it is read, and either two consumer warpgroups in one CTA per value head (`shared_head`, V = 2
BV) or one in a CTA per state block (`producer`, `_body`'s grid). The reverse pass (`_reverse_body`) walks the
chunks last to first in `_body`'s grid, with `emit_pipeline` or (`producer`) the same producer warpgroup, or in
one CTA per value head with two consumers (`shared_head`; opt-in: 3.727 against 3.692 ms forward+backward at
8x2048x16x128 on the H100, 2026-12-06). With one
stage, the producer fetches the next chunk's first inputs while this chunk's last products run, where
`emit_pipeline` waits for the whole step: H100, 2026-12-06, 16 to 64 value heads at K = V = 128, the forward 11-13%
faster, forward+backward 1-7% with both passes' producers (`kda.MOSAIC_PRODUCER_AT_128`,
`kda.MOSAIC_REVERSE_PRODUCER_AT_128`). Supported: K of 64, 128 or 256 (at 256 state blocks of
16 columns and the one-warpgroup layout; opt-in, `DISPATCH_KEY_DIMS`), V of 64, 128 or 256, C = 64, bf16 inputs
(`check_supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc
from deltajax.kernels.gpu.common import split_bf16_in_xla

F32, BF16 = mc.F32, mc.BF16
CHUNK = 64
# K: the C x K operand tiles of a pipeline stage take most of the SMEM. V only sets the grid: V / BV CTAs per head.
KEY_DIMS = (64, 128, 256)
VALUE_DIMS = (64, 128, 256)
BLOCK_VS = (32, 64)
# At K = 256 one stage's five operand tiles take 160 KiB, so the state blocks are 16 columns wide: lowered for an
# H100 at 32 the forward pass asked 256,008 bytes of SMEM (232,448 available), at 16 both passes fit. Compiled and
# tested on an H100 (2026-12-06), but slower there than the Triton passes (8x2048x16x256: forward 10.05 against
# 6.34 ms, forward+backward 22.6 against 15.3; docs/benchmarks.md), so the dispatch's "mosaic" runs KDA's Mosaic
# passes at `DISPATCH_KEY_DIMS` only (K = 256 is opt-in: `kda.Config.pass_backend` / `reverse_backend` "mosaic"
# with `mosaic_block_v=WIDE_KEY_BLOCK_V`).
WIDE_KEY_DIM, WIDE_KEY_BLOCK_V = 256, 16
DISPATCH_KEY_DIMS = (64, 128)
STAGES = 1  # chunks in flight in the TMA pipeline: two stages do not fit SMEM (module docstring)
PRODUCER_REGISTERS = 40  # per thread of the shared-head kernel's producer warpgroup; the consumers get 232
OUTPUT_DOTS = ("split", "bf16")


def check_supported(*, key_dim, value_dim, chunk_size, dtype, block_v, output_dots):
    """Raises ValueError naming what the Mosaic pass does not take."""
    if key_dim not in KEY_DIMS or value_dim not in VALUE_DIMS:
        raise ValueError(f"the Mosaic KDA pass takes K in {KEY_DIMS} and V in {VALUE_DIMS}, got K={key_dim}, "
                         f"V={value_dim}")
    if chunk_size != CHUNK:
        raise ValueError(f"the Mosaic KDA pass takes chunk_size {CHUNK}, got {chunk_size}")
    if jnp.dtype(dtype) != BF16:
        raise ValueError(f"the Mosaic KDA pass takes bfloat16 q/k/v, got {jnp.dtype(dtype).name}")
    if key_dim == WIDE_KEY_DIM and block_v != WIDE_KEY_BLOCK_V:
        raise ValueError(f"the Mosaic KDA pass at K={key_dim} takes block_v={WIDE_KEY_BLOCK_V} (shared memory), got "
                         f"{block_v}")
    if key_dim != WIDE_KEY_DIM and block_v not in BLOCK_VS:
        raise ValueError(f"the Mosaic KDA pass takes block_v in {BLOCK_VS}, got {block_v}")
    if output_dots not in OUTPUT_DOTS:
        raise ValueError(f"output_dots must be one of {OUTPUT_DOTS}, got {output_dots!r}")


def _swizzle(block_v):
    """wgmma takes A and B with one swizzle: that of the state block's rows (128 bytes at BV = 64, 64 at 32)."""
    return min(mc.SWIZZLE, block_v * jnp.dtype(BF16).itemsize)


def _split_product(acc_ref, pairs):
    """Issues hi*hi + hi*lo + lo*hi for each ((a_hi, a_lo), (b_hi, b_lo)) in `pairs` (a lo or b lo None: that
    term is left out) into one accumulator."""
    for (a_hi, a_lo), (b_hi, b_lo) in pairs:
        plgpu.wgmma(acc_ref, a_hi, b_hi)
        if b_lo is not None:
            plgpu.wgmma(acc_ref, a_hi, b_lo)
        if a_lo is not None:
            plgpu.wgmma(acc_ref, a_lo, b_hi)


def _input_names(split_output):
    """The pipeline's inputs in the order the chunk step first reads them, which is the order in which the producer
    of the shared-head kernel refills them for the next chunk."""
    qa = ("qa_hi", "qa_lo") if split_output else ("qa_hi",)
    return ("ak", "v", "beta", "t_hi", "t_lo") + qa + ("p_hi", "p_lo", "ke_hi", "ke_lo", "gamma")


def _no_barrier(*names):
    del names


def _chunk_step(tiles, x, s, out_tiles, *, scale, split_output, block_v, ready=_no_barrier, done=_no_barrier):
    """One chunk for the state block s (K x BV fp32, WGMMA layout): writes O's tile (and, differentiated, the start
    state and u's pair) and returns the next state. x: the chunk's SMEM inputs by name (`_input_names`).
    `ready(*names)` waits until those inputs have arrived and `done(*names)` releases them to the producer (the
    shared-head kernel; no-ops under `emit_pipeline`, which does both per chunk). tiles: S's pair (s_lo None with
    plain bf16 output products), the operand pair x, then the pair of u and the output tile, or None for both: u
    then goes through x once T diag(beta) y has completed, and O through x's hi tile once u's products have."""
    s_hi, s_lo, x_hi, x_lo, u_hi, u_lo, o_smem = tiles
    C, K, BV = CHUNK, s_hi.shape[0], block_v
    one_pair = u_hi is None
    if one_pair:
        u_hi, u_lo, o_smem = x_hi, x_lo, x_hi
    o_tile, *saved = out_tiles
    if one_pair:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's copies out of s_hi and x have read
    if split_output:
        mc.store_split(s, s_hi, s_lo)
    else:
        mc.store_rounded(s, s_hi)
    plgpu.commit_smem()  # generic-proxy stores, visible to the wgmmas (async proxy)
    if saved:
        # bf16(S) is what (A.K) S reads. The copy has read s_hi before the next chunk writes it: the wait before
        # the output tile (or at the top of the next chunk) waits for every earlier copy.
        plgpu.copy_smem_to_gmem(s_hi, saved[0])

    def key_state(acc_ref):
        plgpu.wgmma(acc_ref, x["ak"], s_hi)
        return mc.read(acc_ref)

    ready("ak")
    ks = pl.run_scoped(key_state, mc.acc(C, BV))
    done("ak")
    ready("v", "beta")
    y = mc.wgmma_layout(plgpu.load(x["v"], layout=plgpu.Layout.WGMMA).astype(F32) - ks)  # (4)
    mc.store_split(mc.rows(x["beta"], BV) * y, x_hi, x_lo)
    done("v", "beta")
    plgpu.commit_smem()

    def pseudo_values(acc_ref):
        _split_product(acc_ref, [((x["t_hi"], x["t_lo"]), (x_hi, x_lo))])
        return mc.read(acc_ref)

    ready("t_hi", "t_lo")
    u = pl.run_scoped(pseudo_values, mc.acc(C, BV))
    done("t_hi", "t_lo")
    mc.store_split(u, u_hi, u_lo)
    plgpu.commit_smem()
    if saved:
        plgpu.copy_smem_to_gmem(u_hi, saved[1])
        plgpu.copy_smem_to_gmem(u_lo, saved[2])

    qa = (x["qa_hi"], x["qa_lo"] if split_output else None)
    transposed = lambda ref: ref.transpose((1, 0))

    def output_and_update(o_ref, update_ref):  # (5), scale-free, and (6)
        _split_product(o_ref, [(qa, (s_hi, s_lo)), ((x["p_hi"], x["p_lo"]), (u_hi, u_lo))])
        _split_product(update_ref, [((transposed(x["ke_hi"]), transposed(x["ke_lo"])), (u_hi, u_lo))])
        return mc.read(o_ref, update_ref)

    late = [name for name in _input_names(split_output) if name.startswith(("qa", "p_", "ke"))]
    ready(*late)
    o, update = pl.run_scoped(output_and_update, mc.acc(C, BV), mc.acc(K, BV))
    done(*late)
    ready("gamma")
    s_next = mc.wgmma_layout(mc.rows(x["gamma"], BV) * s + update)
    done("gamma")
    # The previous chunk's output (one tile per CTA), or this chunk's u copies (one pair), have left the tile.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    mc.store_rounded(scale * o, o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_tile)
    return s_next


def _in_specs(names, key_dim, block_v, swizzle, nt=None):
    """The pipeline's BlockSpecs for `names` (the operands' blocks C x key_dim, v's or dO's C x block_v); with `nt`
    (the reverse pass) step n reads chunk nt - 1 - n."""
    C, K = CHUNK, key_dim
    chunk = (lambda n: n) if nt is None else (lambda n: nt - 1 - n)
    tiled = lambda shape: mc.tiled_spec(shape, lambda n: (chunk(n), 0), swizzle)
    vector = lambda n: plgpu.BlockSpec(block_shape=(n,), index_map=lambda i: (chunk(i),))
    shapes = dict(v=(C, block_v), do=(C, block_v), t_hi=(C, C), t_lo=(C, C), p_hi=(C, C), p_lo=(C, C))
    return [vector(C) if name == "beta" else vector(K) if name == "gamma" else tiled(shapes.get(name, (C, K)))
            for name in names]


def _split_refs(refs, n_operands, with_states):
    """(the GMEM inputs by name but for v's columns: a function of them, h0, the outputs, the scratch)."""
    operands = refs[:n_operands]
    v_ref, t_hi, t_lo, p_hi, p_lo, beta_ref, gamma_ref, h0_ref = refs[n_operands:n_operands + 8]
    n_out = 5 if with_states else 2
    outputs = refs[n_operands + 8:n_operands + 8 + n_out]
    names = ("qa_hi", "qa_lo", "ak", "ke_hi", "ke_lo") if n_operands == 5 else ("qa_hi", "ak", "ke_hi", "ke_lo")

    def gmem(b, h, bh, cols):
        refs = {name: ref.at[b, :, h, :] for name, ref in zip(names, operands)}
        refs.update(v=v_ref.at[b, :, h, cols], beta=beta_ref.at[bh], gamma=gamma_ref.at[bh])
        halves = dict(t_hi=t_hi, t_lo=t_lo, p_hi=p_hi, p_lo=p_lo)
        refs.update({name: ref.at[b, :, h, :] for name, ref in halves.items()})
        return refs

    return gmem, h0_ref, outputs, refs[n_operands + 8 + n_out:]


def _out_tiles(outputs, b, h, i, cols, key_dim):
    """Chunk i's GMEM tiles of O and (differentiated) of the start state and u's halves."""
    C, K = CHUNK, key_dim
    _, o_ref, *saved_refs = outputs
    tiles = [o_ref.at[b, pl.ds(i * C, C), h, cols]]
    if saved_refs:
        tiles += [saved_refs[0].at[b, h, pl.ds(i * K, K), cols],
                  *(ref.at[b, pl.ds(i * C, C), h, cols] for ref in saved_refs[1:])]
    return tiles


def _body(*refs, n_operands, with_states, nt, num_heads, scale, split_output, block_v):
    """One warpgroup, CTA (j, bh): value head bh = b * Hv + h, state columns [BV j, BV (j + 1)). refs: the stored
    operand tiles (B, Tp, Hv, K) each, v (B, Tp, Hv, V), T's and P's bf16 halves (B, Tp, Hv, C) each (T hi, T lo,
    P hi, P lo), beta (B*Hv, Tp), gamma (B*Hv, nt*K), the initial state (B, Hv, K, V); then the final state, O and
    (`with_states`) the start states and u's halves; then the scratch (`_scratch`)."""
    gmem, h0_ref, outputs, scratch = _split_refs(refs, n_operands, with_states)
    s_hi, s_lo, x_pair, u_pair, o_smem = scratch
    tiles = (s_hi, s_lo if split_output else None, x_pair.at[0], x_pair.at[1], u_pair.at[0], u_pair.at[1], o_smem)
    names = _input_names(split_output)
    key_dim = h0_ref.shape[2]
    j = lax.axis_index("v_block")
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    cols = pl.ds(j * block_v, block_v)

    def chunk(indices, *chunk_inputs):
        (i,) = indices
        *chunk_inputs, s = chunk_inputs
        return _chunk_step(tiles, dict(zip(names, chunk_inputs)), s, _out_tiles(outputs, b, h, i, cols, key_dim),
                           scale=scale, split_output=split_output, block_v=block_v)

    # The state block goes between GMEM and registers directly (once per CTA).
    s0 = plgpu.load(h0_ref.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
    pipeline = plgpu.emit_pipeline(chunk, grid=(nt,), in_specs=_in_specs(names, key_dim, block_v, _swizzle(block_v)),
                                   max_concurrent_steps=STAGES, init_carry=s0)
    refs_by_name = gmem(b, h, bh, cols)
    outputs[0].at[b, h, :, cols][...] = pipeline(*(refs_by_name[name] for name in names))
    plgpu.wait_smem_to_gmem(0)


def _consumer_columns(consumers, block_v):
    """(this consumer's state columns, the columns of v or dO the pipeline loads, a function from the pipeline's
    tile to this consumer's columns of it): with two consumers the tile holds the head's V, each takes its half."""
    if consumers == 2:
        cols = pl.ds(lax.axis_index("wg") * block_v, block_v)
        return cols, slice(None), lambda tile: tile.at[:, cols]
    cols = pl.ds(lax.axis_index("v_block") * block_v, block_v)
    return cols, cols, lambda tile: tile


def _barrier_hooks(names, produced, consumed):
    """`ready` and `done` (`_chunk_step`) on a warp-specialized pipeline's barriers of the inputs `names`."""
    produced, consumed = dict(zip(names, produced)), dict(zip(names, consumed))
    ready = lambda *which: [plgpu.barrier_wait(produced[name]) for name in which]
    done = lambda *which: [plgpu.barrier_arrive(consumed[name]) for name in which]
    return ready, done


def _body_producer(*refs, n_operands, with_states, nt, num_heads, scale, split_output, block_v, consumers):
    """A producer warpgroup streams the chunk inputs by TMA and `consumers` warpgroups each carry one state block of
    BV columns. One pipeline stage (SMEM), but each input is released as soon as the step has read it
    (`manual_consumed_barriers`, inputs in the order of first use), so the next chunk's first operands load while
    this chunk's last products run; `_body`'s `emit_pipeline` loads the next chunk only after the whole step. Each
    consumer has S's pair and one operand pair (`_chunk_step`'s one-pair mode).

    consumers = 2: one CTA per value head (`shared_head`, V = 2 BV), whose key-side operands are read once for both
    V halves where `_body`'s two CTAs per head read them twice. consumers = 1: CTA (j, bh) per state block, as
    `_body`'s grid (`producer`)."""
    gmem, h0_ref, outputs, scratch = _split_refs(refs, n_operands, with_states)
    wg = lax.axis_index("wg")
    s_hi, s_lo, x_pair = (ref.at[wg] for ref in scratch)
    tiles = (s_hi, s_lo if split_output else None, x_pair.at[0], x_pair.at[1], None, None, None)
    names = _input_names(split_output)
    key_dim = h0_ref.shape[2]
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    cols, head_cols, own_v = _consumer_columns(consumers, block_v)
    n = len(names)

    def chunk(indices, *args):
        (i,) = indices
        chunk_inputs, produced, consumed, s = args[:n], args[n:2 * n], args[2 * n:3 * n], args[3 * n]
        x = dict(zip(names, chunk_inputs))
        x["v"] = own_v(x["v"])
        ready, done = _barrier_hooks(names, produced, consumed)
        return _chunk_step(tiles, x, s, _out_tiles(outputs, b, h, i, cols, key_dim), scale=scale,
                           split_output=split_output, block_v=block_v, ready=ready, done=done)

    def consumer(run_pipeline):
        s0 = plgpu.load(h0_ref.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
        outputs[0].at[b, h, :, cols][...] = run_pipeline(s0)
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        chunk, grid=(nt,), in_specs=_in_specs(names, key_dim, consumers * block_v, _swizzle(block_v)),
        max_concurrent_steps=STAGES, memory_registers=PRODUCER_REGISTERS, wg_axis="wg", num_compute_wgs=consumers,
        compute_context=consumer, manual_produced_barriers=True, manual_consumed_barriers=True)
    refs_by_name = gmem(b, h, bh, head_cols)
    pipeline(*(refs_by_name[name] for name in names))


def _scratch(key_dim, block_v, consumers, dtype):
    """`_body` (`consumers` None): S's pair, the operand pairs of diag(beta) y and of u, the output tile;
    `_body_producer`: S's pair and one operand pair per consumer. (S's lo tile goes unused with plain bf16 output
    products.)"""
    swizzle = _swizzle(block_v)
    lead = (consumers,) if consumers else ()
    state = mc.tiled(lead + (key_dim, block_v), swizzle)
    pair = mc.tiled(lead + (2, CHUNK, block_v), swizzle)
    if consumers:
        return (state, state, pair)
    return (state, state, pair, pair, plgpu.SMEM((CHUNK, block_v), dtype))


# The reverse pass's inputs (the backward's stored operands with plain bf16 state products: A (.) Q hi, A (.) K as
# its pair, E (.) K hi; `kda._operand_parts`).
REVERSE_OPERANDS = ("qa_hi", "ak_hi", "ak_lo", "ke_hi")
REVERSE_INPUTS = REVERSE_OPERANDS + ("do", "t_hi", "t_lo", "p_hi", "p_lo", "beta", "gamma")
# The producer layout's TMA order: the order in which `_reverse_step` first reads them.
REVERSE_INPUTS_BY_FIRST_USE = ("p_hi", "p_lo", "do", "ke_hi", "t_hi", "t_lo", "beta", "qa_hi", "ak_hi", "ak_lo",
                               "gamma")


def _reverse_step(tiles, x, ds, out_tiles, *, scale, block_v, ready=_no_barrier, done=_no_barrier):
    """`kda._reverse_kernel` for one chunk and the block ds (K x BV fp32) of the cotangent of its end state; returns
    that of its start state, writing the end-state cotangent (bf16) and dx = dL/d(beta y) as its bf16 pair:

        du  = scale P^T dO + (E.K) bf16(dS)            2 + 1 wgmmas (P^T as its pair; a plain bf16 state product)
        dx  = T^T du                                   3 wgmmas
        dS' = gamma dS + scale [(A.Q)^T dO + (A.K)^T (-beta dx / scale)]    1 + 3 wgmmas (one K x BV accumulator)

    the products of the Triton pass with its operand roundings; the second term's operand is split after dividing
    by the scale, so that one accumulator holds the sum (as `mosaic_wy._reverse_step`). `ready` and `done` as in
    `_chunk_step` (the producer layout; inputs in `REVERSE_INPUTS_BY_FIRST_USE`)."""
    s_hi, x_hi, x_lo, dx_hi, dx_lo = tiles
    C, K, BV = CHUNK, s_hi.shape[0], block_v
    dend_tile, dx_hi_tile, dx_lo_tile = out_tiles
    transposed = lambda ref: ref.transpose((1, 0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's copies have read dS's and dx's tiles
    mc.store_rounded(ds, s_hi)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_hi, dend_tile)

    def cotangent_of_u(pdo_ref, kd_ref):
        _split_product(pdo_ref, [((transposed(x["p_hi"]), transposed(x["p_lo"])), (x["do"], None))])
        plgpu.wgmma(kd_ref, x["ke_hi"], s_hi)
        return mc.read(pdo_ref, kd_ref)

    ready("p_hi", "p_lo", "do", "ke_hi")
    pdo, kd = pl.run_scoped(cotangent_of_u, mc.acc(C, BV), mc.acc(C, BV))
    done("p_hi", "p_lo", "ke_hi")
    mc.store_split(scale * pdo + kd, x_hi, x_lo)  # du
    plgpu.commit_smem()

    def cotangent_of_beta_y(acc_ref):
        _split_product(acc_ref, [((transposed(x["t_hi"]), transposed(x["t_lo"])), (x_hi, x_lo))])
        return mc.read(acc_ref)

    ready("t_hi", "t_lo")
    dx = pl.run_scoped(cotangent_of_beta_y, mc.acc(C, BV))
    done("t_hi", "t_lo")
    mc.store_split(dx, dx_hi, dx_lo)
    ready("beta")
    mc.store_split((-1.0 / scale) * mc.rows(x["beta"], BV) * dx, x_hi, x_lo)  # x is free: T^T du has completed
    done("beta")
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dx_hi, dx_hi_tile)
    plgpu.copy_smem_to_gmem(dx_lo, dx_lo_tile)

    def start_cotangent(acc_ref):
        plgpu.wgmma(acc_ref, transposed(x["qa_hi"]), x["do"])
        _split_product(acc_ref, [((transposed(x["ak_hi"]), transposed(x["ak_lo"])), (x_hi, x_lo))])
        return mc.read(acc_ref)

    ready("qa_hi", "ak_hi", "ak_lo")
    update = pl.run_scoped(start_cotangent, mc.acc(K, BV))
    done("qa_hi", "do", "ak_hi", "ak_lo")
    ready("gamma")
    ds_start = mc.wgmma_layout(mc.rows(x["gamma"], BV) * ds + scale * update)
    done("gamma")
    return ds_start


def _reverse_body(*refs, nt, num_heads, scale, block_v, consumers):
    """Walks the chunks last to first. refs: the stored operands (`REVERSE_OPERANDS`, (B, Tp, Hv, K) each), dO (B,
    Tp, Hv, V), T's and P's bf16 halves (B, Tp, Hv, C) each, beta (B*Hv, Tp), gamma (B*Hv, nt*K), the final state's
    cotangent (B, Hv, K, V); then dL/d(initial state), the end-state cotangents and dx's halves; then the scratch:
    dS's bf16 tile, the operand pair of du (then of -beta dx / scale) and dx's pair (one set per consumer with a
    producer). `consumers` None: one warpgroup per CTA (j, bh) under `emit_pipeline`; 1: the same CTA with a
    producer warpgroup that releases each input as soon as the step has read it, as `_body_producer`; 2: one CTA
    per value head, two consumers each with a V half (V = 2 BV), the key-side inputs loaded once for both."""
    n_in = len(REVERSE_OPERANDS)
    operands = refs[:n_in]
    do_ref, t_hi, t_lo, p_hi, p_lo, beta_ref, gamma_ref, dfinal_ref = refs[n_in:n_in + 8]
    dh0_ref, dends_ref, dx_hi_ref, dx_lo_ref = refs[n_in + 8:n_in + 12]
    scratch = refs[n_in + 12:]
    C, K = CHUNK, dfinal_ref.shape[2]
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    if consumers:
        scratch = [ref.at[lax.axis_index("wg")] for ref in scratch]
    s_hi, x_pair, dx_pair = scratch
    tiles = (s_hi, x_pair.at[0], x_pair.at[1], dx_pair.at[0], dx_pair.at[1])
    cols, head_cols, own_do = _consumer_columns(consumers, block_v)
    gmem = {name: ref.at[b, :, h, :] for name, ref in zip(REVERSE_OPERANDS, operands)}
    gmem.update(do=do_ref.at[b, :, h, head_cols], t_hi=t_hi.at[b, :, h, :], t_lo=t_lo.at[b, :, h, :],
                p_hi=p_hi.at[b, :, h, :], p_lo=p_lo.at[b, :, h, :], beta=beta_ref.at[bh], gamma=gamma_ref.at[bh])
    names = REVERSE_INPUTS_BY_FIRST_USE if consumers else REVERSE_INPUTS
    in_specs = _in_specs(names, K, (consumers or 1) * block_v, _swizzle(block_v), nt=nt)

    def step(n, chunk_inputs, ds, **barriers):
        i = nt - 1 - n
        x = dict(zip(names, chunk_inputs))
        x["do"] = own_do(x["do"])
        out_tiles = (dends_ref.at[b, h, pl.ds(i * K, K), cols], dx_hi_ref.at[b, pl.ds(i * C, C), h, cols],
                     dx_lo_ref.at[b, pl.ds(i * C, C), h, cols])
        return _reverse_step(tiles, x, ds, out_tiles, scale=scale, block_v=block_v, **barriers)

    def run(run_pipeline):
        ds0 = plgpu.load(dfinal_ref.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
        dh0_ref.at[b, h, :, cols][...] = run_pipeline(ds0)
        plgpu.wait_smem_to_gmem(0)

    if not consumers:
        def chunk(indices, *chunk_inputs):
            *chunk_inputs, ds = chunk_inputs
            return step(indices[0], chunk_inputs, ds)

        run(lambda ds0: plgpu.emit_pipeline(chunk, grid=(nt,), in_specs=in_specs, max_concurrent_steps=STAGES,
                                            init_carry=ds0)(*(gmem[name] for name in names)))
        return
    m = len(names)

    def chunk(indices, *args):
        chunk_inputs, produced, consumed, ds = args[:m], args[m:2 * m], args[2 * m:3 * m], args[3 * m]
        ready, done = _barrier_hooks(names, produced, consumed)
        return step(indices[0], chunk_inputs, ds, ready=ready, done=done)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        chunk, grid=(nt,), in_specs=in_specs, max_concurrent_steps=STAGES, memory_registers=PRODUCER_REGISTERS,
        wg_axis="wg", num_compute_wgs=consumers, compute_context=run, manual_produced_barriers=True,
        manual_consumed_barriers=True)
    pipeline(*(gmem[name] for name in names))


def _layout(*, shared_head, producer, block_v, batch_heads, value_dim, name):
    """(consumers, `mc.kernel`'s grid arguments) of a pass's layout: one warpgroup per CTA (j, bh) (consumers None),
    the same grid with a producer beside the consumer (`producer`, 1), or one CTA per value head with two consumers
    (`shared_head`, 2; V = 2 BV)."""
    if shared_head and 2 * block_v != value_dim:
        raise ValueError(f"shared_head gives each consumer half of V: block_v must be {value_dim // 2}, got {block_v}")
    if shared_head and producer:
        raise ValueError("shared_head and producer are two layouts: at most one of them")
    if shared_head:
        return 2, dict(grid=(batch_heads,), grid_names=("head",), num_threads=3, thread_name="wg",
                       kernel_name=f"{name}_shared_head")
    grid = dict(grid=(value_dim // block_v, batch_heads), grid_names=("v_block", "head"))
    if producer:
        return 1, dict(grid, num_threads=2, thread_name="wg", kernel_name=f"{name}_producer")
    return None, dict(grid, kernel_name=name)


def reverse_pass(operands, beta, t, p, do, dfinal, *, scale, block_v=64, producer=False, shared_head=False,
                 interpret=False):
    """`kda._reverse_pass` in Mosaic GPU: (dL/d(initial state) (B, Hv, K, V) fp32, every chunk's end-state cotangent
    (bf16, (B, Hv, nt*K, V)), dx's bf16 (hi, lo) halves ((B, Tp, Hv, V) each)). operands: the backward's stored
    operands for bf16 inputs with plain bf16 state products (`REVERSE_OPERANDS`, then gamma (B, Hv, nt*K)); T and P
    as bf16 (hi, lo) pairs (or fp32, split here); dO (B, Tp, Hv, V) bf16; dfinal (B, Hv, K, V) fp32."""
    *tiles, gamma = operands
    B, Tp, Hv, V = do.shape
    K = tiles[0].shape[-1]
    check_supported(key_dim=K, value_dim=V, chunk_size=CHUNK, dtype=do.dtype, block_v=block_v, output_dots="bf16")
    if len(tiles) != len(REVERSE_OPERANDS):
        raise ValueError(f"the reverse pass reads {len(REVERSE_OPERANDS)} operand tiles {REVERSE_OPERANDS} (plain "
                         f"bf16 state products), got {len(tiles)}")
    nt = Tp // CHUNK
    as_pair = lambda x: tuple(x) if isinstance(x, (tuple, list)) else split_bf16_in_xla(x)
    heads_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(B * Hv, Tp)
    out_type = (jax.ShapeDtypeStruct((B, Hv, K, V), F32), jax.ShapeDtypeStruct((B, Hv, nt * K, V), BF16),
                *(jax.ShapeDtypeStruct((B, Tp, Hv, V), BF16),) * 2)
    consumers, grid = _layout(shared_head=shared_head, producer=producer, block_v=block_v, batch_heads=B * Hv,
                              value_dim=V, name="kda_reverse_mosaic")
    swizzle = _swizzle(block_v)
    lead = (consumers,) if consumers else ()
    scratch = (mc.tiled(lead + (K, block_v), swizzle), mc.tiled(lead + (2, CHUNK, block_v), swizzle),
               mc.tiled(lead + (2, CHUNK, block_v), swizzle))
    body = functools.partial(_reverse_body, nt=nt, num_heads=Hv, scale=float(scale), block_v=block_v,
                             consumers=consumers)
    kernel = mc.kernel(body, out_type=out_type, scratch_types=scratch, compiler_params=plgpu.CompilerParams(),
                       interpret=interpret, **grid)
    dh0, dends, dx_hi, dx_lo = kernel(*tiles, do, *as_pair(t), *as_pair(p), heads_major(beta.astype(F32)),
                                      gamma.reshape(B * Hv, nt * K), dfinal)
    return dh0, dends, (dx_hi, dx_lo)


def forward_pass(operands, v, beta, t, p, h0, *, scale, output_dots="split", block_v=64, shared_head=False,
                 producer=False, with_states=False, interpret=False):
    """(O, final state), and `with_states` every chunk's start state (bf16, (B, Hv, nt*K, V)) and u's bf16 (hi, lo)
    halves ((B, Tp, Hv, V) each), as `kda._forward_pass` returns them with stored operands.

    operands: the forward's stored operands of `kda._gates_and_operands` for bf16 inputs: A (.) Q as (hi, lo)
    (`output_dots` "split") or hi alone ("bf16"), A (.) K hi, E (.) K (hi, lo), each (B, Tp, Hv, K) bf16, then gamma
    (B, Hv, nt*K) fp32. v (B, Tp, Hv, V) bf16; beta (B, Tp, Hv) fp32; T and P (B, Tp, Hv, C) each as its bf16
    (hi, lo) pair, as `kda._prepare` writes them for this pass (or fp32, split here); h0 (B, Hv, K, V) fp32. Tp a
    multiple of 64. `shared_head`: one CTA per value head (`_body_producer` with two consumers, V blocks of 64);
    `producer`: one CTA per V block of `block_v` with a producer warpgroup (`_body_producer` with one consumer);
    else one warpgroup per V block of `block_v` (`_body`; 16 columns at K = 256)."""
    *tiles, gamma = operands
    B, Tp, Hv, V = v.shape
    K = tiles[0].shape[-1]
    check_supported(key_dim=K, value_dim=V, chunk_size=CHUNK, dtype=v.dtype, block_v=block_v,
                    output_dots=output_dots)
    consumers, grid = _layout(shared_head=shared_head, producer=producer, block_v=block_v, batch_heads=B * Hv,
                              value_dim=V, name="kda_forward_mosaic")
    split_output = output_dots == "split"
    if len(tiles) != 4 + split_output:
        raise ValueError(f"output_dots={output_dots!r} reads {4 + split_output} operand tiles, got {len(tiles)}")
    nt = Tp // CHUNK
    as_pair = lambda x: tuple(x) if isinstance(x, (tuple, list)) else split_bf16_in_xla(x)
    heads_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(B * Hv, Tp)
    out_type = (jax.ShapeDtypeStruct((B, Hv, K, V), F32), jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype))
    if with_states:
        out_type += (jax.ShapeDtypeStruct((B, Hv, nt * K, V), BF16),)
        out_type += (jax.ShapeDtypeStruct((B, Tp, Hv, V), BF16),) * 2
    layout = functools.partial(_body_producer, consumers=consumers) if consumers else _body
    body = functools.partial(layout, n_operands=len(tiles), with_states=with_states, nt=nt, num_heads=Hv,
                             scale=float(scale), split_output=split_output, block_v=block_v)
    # No reduction in the producer layouts' kernels crosses warps: the 2 KiB Mosaic GPU reserves for them would not
    # fit beside the shared-head kernel's tiles.
    compiler_params = plgpu.CompilerParams(reduction_scratch_bytes=0) if consumers else plgpu.CompilerParams()
    kernel = mc.kernel(body, out_type=out_type, scratch_types=_scratch(K, block_v, consumers, v.dtype),
                       compiler_params=compiler_params, interpret=interpret, **grid)
    final, o, *saved = kernel(*tiles, v, *as_pair(t), *as_pair(p), heads_major(beta.astype(F32)),
                              gamma.reshape(B * Hv, nt * K), h0)
    if with_states:
        return o, final, saved[0], (saved[1], saved[2])
    return o, final
