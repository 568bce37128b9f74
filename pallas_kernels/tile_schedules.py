"""The persistent TMA pipeline every quantization kernel runs on, with its two tile schedules (static, dynamic).

A grid of `ctas_per_sm` x SMs CTAs streams tiles GMEM -> SMEM -> registers -> SMEM -> GMEM with `stages` TMA loads
in flight; `persistent_kernel` builds it, `run_persistent` / `run_dynamic` decide which tiles a CTA takes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.tiling import SMEM_PER_SM, SMEM_RESERVE, TileConfig

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Stream:
    """One tensor the pipeline moves: its SMEM buffer and where tile t lives in GMEM."""

    gmem: object
    smem: object  # [stages, *tile]
    view: object  # (gmem_ref, tile_index) -> gmem ref slice of one tile


def _fetch(ins, t, slot, barrier) -> None:
    """TMA loads of tile t of every streamed input into pipeline slot `slot`, completing on that slot's barrier."""
    for s in ins:
        plgpu.copy_gmem_to_smem(s.view(s.gmem, t), s.smem.at[slot], barrier.at[slot])


def _store_tile(t, slot, outs, stages: int) -> None:
    """Every thread's SMEM writes of the slot made visible to TMA (fence + CTA barrier), then tile t stored; then the
    storing thread waits until the store issued stages - 1 steps ago has read its buffers, which the next step
    writes. The caller follows this with a CTA barrier (a refill's `copy_gmem_to_smem` has one), so no thread writes
    those buffers before that wait: bulk-copy groups belong to the thread that issued them."""
    plgpu.commit_smem()  # fence + warpgroup barrier: SMEM writes visible to TMA, SMEM reads done
    for s in outs:
        plgpu.copy_smem_to_gmem(s.smem.at[slot], s.view(s.gmem, t), commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)


def run_persistent(body, *, ntiles: int, nct: int, stages: int, ins, outs, barrier, auto_barriers: bool = True):
    """Each of `nct` CTAs walks tiles c, c + nct, ... with `stages` TMA loads in flight.

    Steps past the last tile repeat the last tile (identical bytes written twice: benign), so every CTA
    runs the same static number of steps. body(tile_index, *in_smem_tiles, *out_smem_tiles).
    Barriers each step needs, and where they are: all SMEM writes before the TMA store and all reads of the input
    slot before its refill (commit_smem in _store_tile); the storing thread's wait for the old store before any
    thread writes that store's buffers again (the barrier that closes the step: the refill's automatic one, or an
    explicit one). Bodies need none of their own: they read their input slot and write their output slots only
    (Mosaic's cross-warp reductions bring their own barriers).
    """
    steps = pl.cdiv(ntiles, nct)
    c = lax.axis_index("c")

    def tile(i):
        return jnp.minimum(c + i * nct, ntiles - 1)

    def fetch(i, slot):
        _fetch(ins, tile(i), slot, barrier)

    for j in range(min(stages, steps)):
        fetch(j, j)

    @pl.loop(0, steps)
    def _step(i):
        slot = lax.rem(i, stages)
        t = tile(i)
        plgpu.barrier_wait(barrier.at[slot])
        body(t, *(s.smem.at[slot] for s in ins), *(s.smem.at[slot] for s in outs))
        _store_tile(t, slot, outs, stages)
        refill = i + stages < steps

        @pl.when(refill)
        def _refill():
            fetch(i + stages, slot)  # with automatic barriers, copy_gmem_to_smem starts with a CTA barrier

        if auto_barriers:
            @pl.when(jnp.logical_not(refill))
            def _sync():
                plgpu.commit_smem()  # the CTA barrier a refill would have given (see _store_tile)
        else:
            plgpu.commit_smem()  # the step's closing CTA barrier (see _store_tile)

    plgpu.wait_smem_to_gmem(0)


_TICKET_LAYOUT = plgpu.Layout.WG_SPLAT((128,))  # one i32 register per thread; only thread 0's holds the ticket


def _take_ticket(counter_gmem):
    """Thread 0 of the CTA issues an atomic add on the GMEM counter; returns its ticket (valid in thread 0 only).

    The atomic is predicated, not branched around, so no join copies the result: thread 0 waits for it only
    where `_publish_tile` stores it, a whole tile of work later.
    """

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((128,), jnp.int32, _TICKET_LAYOUT))
    def take(ctx, counter):
        del ctx
        from jax.experimental.mosaic.gpu import fragmented_array as fa, utils as mgpu_utils  # noqa: PLC0415
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import arith, llvm  # noqa: PLC0415

        i32 = ir.IntegerType.get_signless(32)
        first_thread = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(),
                                                   arith.constant(i32, 0)))
        ticket = llvm.inline_asm(
            i32, [mgpu_utils.memref_ptr(counter), first_thread],
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p atom.add.u32 $0, [$1], 1; }", "=r,l,r",
            has_side_effects=True)
        return fa.FragmentedArray.splat(ticket, (128,), layout=_TICKET_LAYOUT.to_mgpu(), is_signed=True)

    return take(counter_gmem)


def _publish_tile(ticket, id_smem, first: int):
    """Thread 0 writes tile `first + ticket` to id_smem[0]; then warp 0 agrees on it (bar.warp.sync).

    The TMA load of that tile is issued by warp 0's elected lane from the value read back right after, so every lane
    of warp 0 must see the write. The other warps read the slot for their own use only after the next CTA barrier.
    """

    @plgpu.inline_mgpu(arg_types=(_TICKET_LAYOUT, plgpu.RefType()))
    def publish(ctx, ticket, slot):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import arith, llvm, memref, scf  # noqa: PLC0415

        i32 = ir.IntegerType.get_signless(32)
        value = arith.addi(ticket.registers.flat[0], arith.constant(i32, first))
        first_thread = arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), arith.constant(i32, 0))
        branch = scf.IfOp(first_thread)
        with ir.InsertionPoint(branch.then_block):
            memref.store(value, slot, [arith.constant(ir.IndexType.get(), 0)])
            scf.yield_([])
        llvm.inline_asm(None, [], "bar.warp.sync -1;", "", has_side_effects=True)

    publish(ticket, id_smem)


def run_dynamic(body, *, ntiles: int, nct: int, stages: int, ins, outs, barrier, counter, ids,
                auto_barriers: bool = True):
    """Like run_persistent, but after its first `stages` tiles (c + j nct, static) a CTA takes tiles from `counter`.

    Why: the grid is `ctas_per_sm` x SMs CTAs, and when fewer fit on an SM at once (registers, SMEM) the rest run
    in a second, partial wave; with equal static shares the SMs then finish far apart (Nsight Compute: 18-23 % of
    the kernel's cycles the average SM idles, decision record 0006). With a shared counter a CTA that starts late
    simply takes fewer tiles.

    Order of events for the tile of step i + stages (stages >= 2): thread 0 takes a ticket before computing tile i
    (the atomic's latency hides behind the tile), and after step i's CTA-wide barrier (commit_smem) writes the tile
    to ids[slot]; warp 0 reads it back and issues its TMA load; every thread reads ids[slot] again after the barrier
    of step i + stages - 1, which follows the write. The other warps may still see the slot's old index when the load
    is issued, so the load is issued unconditionally (an index past the end loads the last tile again): with Pallas'
    automatic barriers `copy_gmem_to_smem` contains a CTA barrier, which every warp must reach. Tickets are taken in
    step order, so a CTA's tiles increase and its first tile past the end ends its loop; the `stages` loads still in
    flight then (each a repeat of the last tile) are waited for before the CTA exits, so none lands in SMEM that the
    next CTA on the SM already owns.
    """
    c = lax.axis_index("c")
    first = stages * nct
    last = ntiles - 1

    def fetch(t, slot):
        _fetch(ins, jnp.minimum(t, last), slot, barrier)

    for j in range(stages):
        fetch(c + j * nct, j)

    def step(carry):
        i, t = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(barrier.at[slot])
        ticket = _take_ticket(counter)  # in flight while the tile is computed
        body(t, *(s.smem.at[slot] for s in ins), *(s.smem.at[slot] for s in outs))
        _store_tile(t, slot, outs, stages)
        _publish_tile(ticket, ids.at[pl.ds(slot, 1)], first)
        fetch(ids[slot], slot)  # the tile of step i + stages (warp 0 issues it, from the index it just published)
        if not auto_barriers:
            plgpu.commit_smem()  # the step's closing CTA barrier (see _store_tile)
        nxt = i + 1
        t_next = jnp.where(nxt < stages, c + nxt * nct, ids[lax.rem(nxt, stages)])
        return nxt, t_next

    done, _ = lax.while_loop(lambda carry: carry[1] < ntiles, step, (jnp.int32(0), c))
    for j in range(stages):  # drain: the loads of steps done .. done + stages - 1 were issued and never consumed
        plgpu.barrier_wait(barrier.at[lax.rem(done + j, stages)])
    plgpu.wait_smem_to_gmem(0)


def persistent_kernel(body, *, name, out_shapes, in_tiles, out_tiles, ntiles, cfg: TileConfig, interpret,
                      n_extra_in: int = 0, extra_out=(), prologue=None, prologue_scratch=()):
    """Builds a plgpu.kernel over a persistent grid that streams tiles through SMEM.

    in_tiles / out_tiles: (tile_shape, dtype, transforms, view) per streamed tensor; view(gmem_ref, t) is tile t.
    The kernel's arguments are the streamed inputs then `n_extra_in` whole-GMEM inputs; its outputs are
    `out_shapes` (streamed) then `extra_out` (whole-GMEM, written by the body directly).
    body(t, *in_smem_tiles, *out_smem_tiles, *extra_in_gmem, *extra_out_gmem) computes tile t.
    prologue(*extra_in_gmem, *extra_out_gmem, *scratch_refs), if given, runs once per CTA before the first tile; what
    it returns is passed to every body call as one more trailing argument (loop-invariant values, e.g. a scale for
    every tile, or an SMEM table it filled: `prologue_scratch` are the SMEM buffers it gets, e.g. plgpu.SMEM(...)).
    """
    stages = cfg.stages
    tile_bytes = sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype, _, _ in (*in_tiles, *out_tiles))
    resident = max(1, min(cfg.ctas_per_sm, SMEM_PER_SM // (stages * tile_bytes + SMEM_RESERVE)))
    nct = max(1, min(ntiles, interpret_mode.num_sms(interpret) * resident))
    stages = max(1, min(stages, pl.cdiv(ntiles, nct)))
    dynamic = cfg.schedule == "dynamic" and not interpret  # the interpreter can't run the inline atomic
    if dynamic:
        stages = max(2, stages)
    smem = [plgpu.SMEM((stages, *shape), dtype, transforms=tr) for shape, dtype, tr, _ in (*in_tiles, *out_tiles)]
    if dynamic:
        smem.append(plgpu.SMEM((stages,), jnp.int32))  # the tile index of each pipeline slot
    n_stream_smem = len(smem)
    smem += list(prologue_scratch)
    barrier = plgpu.Barrier(num_arrivals=len(in_tiles), num_barriers=stages)
    n_in, n_out, n_xout, n_counter = len(in_tiles), len(out_tiles), len(extra_out), int(dynamic)

    def kernel(*refs):
        gmem_in, refs = refs[:n_in], refs[n_in:]
        extra_in, refs = refs[:n_extra_in], refs[n_extra_in:]
        counter, refs = refs[:n_counter], refs[n_counter:]
        gmem_out, refs = refs[:n_out], refs[n_out:]
        extra_gmem_out, refs = refs[:n_xout], refs[n_xout:]
        smem_refs, pro_refs, bar = refs[:n_stream_smem], refs[n_stream_smem: len(smem)], refs[len(smem)]
        ins = [Stream(g, s, v[3]) for g, s, v in zip(gmem_in, smem_refs[:n_in], in_tiles)]
        outs = [Stream(g, s, v[3]) for g, s, v in zip(gmem_out, smem_refs[n_in:], out_tiles)]
        extra = (*extra_in, *extra_gmem_out)
        run = functools.partial(_call_body, body, extra if prologue is None else (*extra, prologue(*extra, *pro_refs)))
        if dynamic:
            run_dynamic(run, ntiles=ntiles, nct=nct, stages=stages, ins=ins, outs=outs, barrier=bar,
                        counter=counter[0], ids=smem_refs[-1], auto_barriers=cfg.auto_barriers)
        else:
            run_persistent(run, ntiles=ntiles, nct=nct, stages=stages, ins=ins, outs=outs, barrier=bar,
                           auto_barriers=cfg.auto_barriers)

    call = plgpu.kernel(
        kernel,
        out_type=(*out_shapes, *extra_out),
        grid=(nct,),
        grid_names=("c",),
        scratch_types=(*smem, barrier),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=not cfg.auto_barriers),
        kernel_name=name + ("_dyn" if dynamic else ""),
    )
    if not dynamic:
        return call

    def with_counter(*args):
        # A fresh zeroed counter per call, passed as a mutable ref (XLA aliases it into the kernel: no stale
        # tickets from an earlier call). 16 bytes: the smallest GMEM allocation Mosaic aligns for. The zeros are
        # made to depend on the input (its first element's bits AND 0), so that partial evaluation (jax.checkpoint
        # and scan under jax.grad) keeps the ref's creation on the kernel's side: a ref can't be a residual.
        first = args[0].reshape(-1)[:1].astype(F32)
        zeros = jnp.zeros((4,), jnp.int32) + (lax.bitcast_convert_type(first, jnp.int32) & 0)
        return call(*args, jax.new_ref(zeros))

    return with_counter


def _call_body(body, extra, t, *tiles):
    body(t, *tiles, *extra)
