"""The CUDA form of the fused attention kernel (:mod:`.attention` is the CPU one):
``softmax(Q K^T * scale + mask) V`` with an online softmax, FlashAttention-2 style on CUDA
cores, one scheduled TIR PrimFunc (``tirx.is_scheduled``; ``op_pattern`` opaque).

``attention_kernel_cuda(d, dv, scale, mask_dims, empty_rows, where_fill, dtype)`` -> PrimFunc
with the parameters of :func:`.attention.attention_kernel` (``q (B, H, S, D)``,
``kt (B, H, D, N)``, ``v (B, H, N, Dv)``[, mask], ``o (B, H, S, Dv)``), in ``dtype`` (float32
or float16: the products, sums, maxima and exponentials in float32, the output cast once).

One thread block per (batch x head, ``BQ`` = 32 query rows), ``G`` thread groups of ``BQ``
threads (:func:`tile`; ``G`` = 4, 128 threads, at ``D`` = ``Dv`` = 64): thread ``g * BQ + r``
takes row ``r``, the ``g``-th ``KB / G`` keys of each block's scores and the ``g``-th
``Dv / G`` output columns (a warp is one group: its K^T and V reads are broadcasts). The
block's scaled Q is staged once into shared memory, transposed (``(D, BQ)``). Then per block
of ``KB`` = 64 keys (32 at ``D`` = 128):

1. with a mask that can make scores ``-inf``: the block's mask values read by all threads
   (coalesced), their OR over the block by ``__syncthreads_or``, the block skipped by every
   thread when no score of it is visible (a causal mask's blocks above the diagonal: no K, V
   read, no flops);
2. the block's K^T (``(D, KB)``) staged through shared memory (coalesced loads, float32);
3. each thread's ``KB / G`` scores in registers (4 keys a 128-bit shared load), masked (keys
   past ``N`` ``-inf``), their maximum into shared memory;
4. the row's new maximum (over the ``G`` groups), the correction ``exp(m_old - m_new)``, the
   thread's exponentials into ``P`` (shared, ``(KB, BQ)``) and its part of the row's sum, in
   registers;
5. the block's V (``(KB, Dv)``) staged into K^T's place;
6. the thread's ``Dv / G`` accumulators (registers) corrected and added ``P[r, j] V[j, :]``.

``bar.sync`` between the phases. At the end the row's sum is added up over the groups (through
shared memory) and each thread writes its columns once, ``acc / l`` (128-bit stores at
float32); rows past ``S`` are not written, a row whose every score is ``-inf`` gets
``empty_rows`` as on the CPU. ``B, H, S, N`` are symbolic (every K / V / mask load predicated
on ``N``, rows clamped to ``S``); ``D, Dv`` static. The ``(B, H, S, N)`` scores never exist in
memory; shared memory per block :func:`smem_bytes` (33 KB at ``D`` = 64).
``__launch_bounds__(threads, 1)``: with the default ptxas held the kernel to the 80-128
registers of 4-6 blocks an SM and spilled a few bytes; now 150-200 registers, no spills
(sm_90, D = 64 and 128, float32 and float16). CUDA cores only (no ``mma``).

``serial=True`` gives the same program with each phase a serial loop over the threads and
the per-thread buffers indexed by the thread: its meaning, runnable on llvm (the barriers are
where the phases end).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

SMEM_BUDGET = 48 * 1024  # static shared memory per block
MAX_HEAD_DIM = 128  # the accumulator and the scores per thread within 255 registers
# (BQ query rows, G key groups, KB keys per block), the first that fits (:func:`tile`)
_SHAPES = ((32, 4, 64), (32, 4, 32), (32, 2, 32), (32, 1, 32))


def tile(d: int, dv: int) -> tuple[int, int, int] | None:
    """``(BQ, G, KB)`` for head dims ``d``, ``dv``: query rows per block, thread groups (the
    block's ``BQ x G`` threads: thread ``g * BQ + r`` takes row ``r``, the ``g``-th ``KB / G``
    keys of each block's scores and the ``g``-th ``Dv / G`` output columns), keys per block;
    None when the kernel does not take them."""
    if max(d, dv) > MAX_HEAD_DIM:
        return None
    for bq, groups, kb in _SHAPES:
        nt = bq * groups
        fits = (
            smem_bytes(d, dv, bq, groups, kb) <= SMEM_BUDGET
            and all(x % nt == 0 for x in (d * bq, d * kb, kb * dv, bq * kb))
            and kb // groups % 4 == 0  # K^T rows read 4 words at a time
            and dv // groups % 4 == 0  # V rows likewise
            and dv % groups == 0
        )
        if fits:
            return bq, groups, kb
    return None


def smem_bytes(d: int, dv: int, bq: int, groups: int, kb: int) -> int:
    """Shared memory of one block: scaled Q^T, the K^T / V block, the probabilities, the
    groups' maxima and sums (or the flags: two per thread)."""
    return 4 * (d * bq + max(d, dv) * kb + kb * bq + 2 * bq * groups)


def supports(d: int, dv: int, dtype: str) -> bool:
    return dtype in ("float32", "float16") and tile(d, dv) is not None


def attention_kernel_cuda(
    d: int,
    dv: int,
    scale: float,
    mask_dims: tuple[bool, bool, bool, bool] | None,
    empty_rows: str = "nan",
    where_fill: tuple[float, bool] | None = None,
    dtype: str = "float32",
    serial: bool = False,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc (see the module docstring). ``where_fill`` and ``mask_dims`` as
    in :func:`.attention.attention_kernel`; an added mask is of ``dtype``."""
    if empty_rows not in ("nan", "zero"):
        raise ValueError(f"empty_rows must be 'nan' or 'zero', not {empty_rows!r}")
    shape = tile(d, dv)
    if shape is None or dtype not in ("float32", "float16"):
        raise ValueError(f"no CUDA attention kernel for D = {d}, Dv = {dv}, {dtype}")
    bq, groups, kb = shape
    nt = bq * groups  # threads
    kg = kb // groups  # keys of a block per thread
    cg = dv // groups  # output columns per thread
    has_mask = mask_dims is not None
    keep = mask_dims if has_mask else (False,) * 4
    skips = has_mask and (where_fill is None or where_fill[0] == float("-inf"))
    f32 = "float32"
    # the loops over D (scores), the mask's flags and the keys (P V) unrolled by 2 (nvcc's own
    # unrolling hoisted more loads: more registers)
    unroll2 = None if serial else 2
    zero, one = tirx.const(0.0, f32), tirx.const(1.0, f32)
    neg_inf = tirx.const(float("-inf"), f32)

    with IRBuilder() as ib, T.prim_func(is_private=True):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        b, h, s, n = (tirx.Var(x, "int64") for x in "bhsn")
        ms = [tirx.Var(f"m{x}", "int64") for x in "bhsn"]

        def param(name, shape, param_dtype):
            # no explicit layout (the builder's default): renew_defs (AttachLayoutFreeBuffers)
            # does not remap a layout's vars
            return T.match_buffer(T.arg(name, T.handle()), shape, param_dtype, layout=None)

        q = param("p_q", (b, h, s, d), dtype)
        kt = param("p_k", (b, h, d, n), dtype)
        v = param("p_v", (b, h, n, dv), dtype)
        mask = None
        if has_mask:
            mask_dtype = "bool" if where_fill is not None else dtype
            mask = param("p_m", ms, mask_dtype)
        o = param("p_o", (b, h, s, dv), dtype)
        tiles = (s + bq - 1) // bq
        nkb = (n + kb - 1) // kb

        def loop_blocks():
            if serial:
                return T.serial(0, b * h * tiles)
            return T.thread_binding(0, b * h * tiles, "blockIdx.x")

        with loop_blocks() as bx:
            # (truncated division: the grid index is not negative, no floor corrections)
            bh = tirx.truncdiv(bx, tiles)
            bb, hh = tirx.truncdiv(bh, h), tirx.truncmod(bh, h)
            row0 = tirx.truncmod(bx, tiles) * bq
            local = "global" if serial else "local"
            shared = "global" if serial else "shared"
            lead = (nt,) if serial else ()
            # scaled Q^T and the K^T / V block in one allocation, the block's probabilities
            # P^T in another, the groups' maxima / sums (or the flags) in a third: ThreadSync
            # takes the accesses to one allocation as overlapping (P is written while K^T and
            # the maxima are read)
            pool = T.decl_buffer((d * bq + max(d, dv) * kb,), f32, scope=shared, layout=None)

            def view(shape, data, offset=0):
                return T.decl_buffer(
                    shape, f32, data=data, elem_offset=offset, scope=shared, layout=None
                )

            qs = view((d, bq), pool.data)
            kvs = view((max(d, dv) * kb,), pool.data, d * bq)
            ps = T.decl_buffer((kb, bq), f32, scope=shared, layout=None)
            aux = T.decl_buffer((2 * nt,), f32, scope=shared, layout=None)
            flags = view((2, nt), aux.data)
            per_group = view((groups, bq), aux.data)
            sc = T.decl_buffer((*lead, kg), f32, scope=local, layout=None)
            acc = T.decl_buffer((*lead, cg), f32, scope=local, layout=None)
            vec = T.decl_buffer((*lead, 4), f32, scope=local, layout=None)  # 4 words at a time
            # m (running maximum), l (running sum), the block's maximum, the correction
            stat = T.decl_buffer((*lead, 4), f32, scope=local, layout=None)
            live = T.decl_buffer((*lead, 1), f32, scope=local, layout=None)

            def at(buf, tx, *idx):
                return buf[(tx, *idx)] if serial else buf[idx]

            def put(buf, tx, idx, value):
                T.buffer_store(buf, value, [tx, *idx] if serial else list(idx))

            def load4(tx, buf, start):
                """``buf[start:start + 4]`` into ``vec`` (one 128-bit shared load)."""
                value = tirx.BufferLoad(buf, [tirx.Ramp(start, 1, 4)])
                put(vec, tx, (tirx.Ramp(0, 1, 4),), value)

            cuda_tx = None

            def phases(body):
                """``body(tx)`` for every thread: a serial loop or the thread itself."""
                if serial:
                    with T.serial(0, nt) as tx:
                        body(tx)
                else:
                    body(cuda_tx)

            def sync():
                if not serial:
                    T.evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))

            def mask_value(i, j):
                index = [x if kept else 0 for x, kept in zip((bb, hh, i, j), keep, strict=True)]
                return mask[tuple(index)]

            def visible(i, j):
                value = mask_value(i, j)
                if where_fill is None:
                    return tirx.Select(value.astype(f32) == neg_inf, zero, one)
                cond = value if where_fill[1] else tirx.Not(value)
                return tirx.Select(cond, one, zero)

            def masked(score, i, j):
                if not has_mask:
                    return score
                value = mask_value(i, j)
                if where_fill is None:
                    return score + value.astype(f32)
                fill, keep_when = where_fill
                cond = value if keep_when else tirx.Not(value)
                return tirx.Select(cond, score, tirx.const(fill, f32))

            def body():
                def load_q(tx):
                    with T.serial(0, d * bq // nt) as i:
                        idx = i * nt + tx
                        r, c = idx // d, idx % d
                        row = T.min(row0 + r, s - 1)
                        value = q[bb, hh, row, c].astype(f32) * tirx.const(scale, f32)
                        T.buffer_store(qs, value, [c, r])
                    put(stat, tx, (0,), neg_inf)
                    put(stat, tx, (1,), zero)
                    with T.unroll(0, cg) as c:
                        put(acc, tx, (c,), zero)

                phases(load_q)
                sync()
                with T.serial(0, nkb) as jb:
                    k0 = jb * kb
                    if skips:
                        _flags(jb, k0)
                        with T.If(at(live, 0 if serial else None, 0) > zero):
                            with T.Then():
                                _block(k0)
                    else:
                        _block(k0)
                    # K^T / V, P and the maxima read before the next block writes them
                    # (outside the condition: a barrier in it is none on the skipping path)
                    sync()
                phases(_publish_sum)
                sync()
                phases(_store)

            def _flags(jb, k0):
                def write(tx):
                    put(live, tx, (0,), zero)
                    with T.serial(0, bq * kb // nt, unroll=unroll2) as i:
                        idx = i * nt + tx
                        r, j = idx // kb, idx % kb
                        ok = tirx.all(row0 + r < s, k0 + j < n)
                        seen = tirx.if_then_else(ok, visible(row0 + r, k0 + j), zero)
                        put(live, tx, (0,), T.max(at(live, tx, 0), seen))
                    if serial:
                        T.buffer_store(flags, at(live, tx, 0), [jb % 2, tx])
                    else:  # a barrier that ORs the threads' flags
                        anyone = tirx.call_extern(
                            "int32", "__syncthreads_or", (at(live, tx, 0) > zero).astype("int32")
                        )
                        put(live, tx, (0,), anyone.astype(f32))

                def read(tx):
                    put(live, tx, (0,), zero)
                    with T.serial(0, nt) as t:
                        put(live, tx, (0,), T.max(at(live, tx, 0), flags[jb % 2, t]))

                phases(write)
                if serial:  # the flags' OR, as __syncthreads_or gives it
                    phases(read)

            def _block(k0):
                def load_k(tx):
                    with T.serial(0, d * kb // nt) as i:
                        idx = i * nt + tx
                        c, j = idx // kb, idx % kb
                        value = kt[bb, hh, c, T.min(k0 + j, n - 1)].astype(f32)
                        T.buffer_store(kvs, tirx.Select(k0 + j < n, value, zero), [c * kb + j])

                def scores(tx):
                    """The thread's ``kg`` scores of its row, masked, and their maximum."""
                    r, g = tx % bq, tx // bq
                    j0 = g * kg  # the thread's first key
                    with T.unroll(0, kg) as j:
                        put(sc, tx, (j,), zero)
                    # the warp's threads share g: K^T read 4 keys at a time, a broadcast
                    with T.serial(0, d, unroll=unroll2) as c:
                        with T.unroll(0, kg // 4) as j4:
                            load4(tx, kvs, c * kb + j0 + j4 * 4)
                            with T.unroll(0, 4) as i:
                                j = j4 * 4 + i
                                put(sc, tx, (j,), at(sc, tx, j) + qs[c, r] * at(vec, tx, i))
                    row = T.min(row0 + r, s - 1)
                    put(stat, tx, (2,), neg_inf)
                    with T.unroll(0, kg) as j:
                        # the mask read where the key exists (a guarded load: no clamp, the
                        # addresses a constant apart)
                        key = k0 + j0 + j
                        score = masked(at(sc, tx, j), row, key)
                        put(sc, tx, (j,), tirx.if_then_else(key < n, score, neg_inf))
                        put(stat, tx, (2,), T.max(at(stat, tx, 2), at(sc, tx, j)))
                    T.buffer_store(per_group, at(stat, tx, 2), [g, r])

                def probabilities(tx):
                    """The row's new maximum (over the groups), the thread's exponentials
                    into P, its part of the row's sum, the correction."""
                    r, g = tx % bq, tx // bq
                    put(stat, tx, (2,), at(stat, tx, 0))
                    for k in range(groups):
                        put(stat, tx, (2,), T.max(at(stat, tx, 2), per_group[k, r]))
                    # the shift: the new maximum, 0 while it is -inf (exp(-inf - 0) = 0)
                    new = at(stat, tx, 2)
                    base = tirx.Select(new == neg_inf, zero, new)
                    put(stat, tx, (3,), T.exp(at(stat, tx, 0) - base))
                    put(stat, tx, (1,), at(stat, tx, 1) * at(stat, tx, 3))
                    with T.unroll(0, kg) as j:
                        put(sc, tx, (j,), T.exp(at(sc, tx, j) - base))
                        put(stat, tx, (1,), at(stat, tx, 1) + at(sc, tx, j))
                        T.buffer_store(ps, at(sc, tx, j), [g * kg + j, r])
                    put(stat, tx, (0,), new)

                def load_v(tx):
                    with T.serial(0, kb * dv // nt) as i:
                        idx = i * nt + tx
                        j, c = idx // dv, idx % dv
                        value = v[bb, hh, T.min(k0 + j, n - 1), c].astype(f32)
                        T.buffer_store(kvs, tirx.Select(k0 + j < n, value, zero), [j * dv + c])

                def update(tx):
                    """The thread's ``cg`` columns: corrected, plus P's row times V."""
                    r, c0 = tx % bq, tx // bq * cg
                    with T.unroll(0, cg) as c:
                        put(acc, tx, (c,), at(acc, tx, c) * at(stat, tx, 3))
                    with T.serial(0, kb, unroll=unroll2) as j:
                        with T.unroll(0, cg // 4) as c4:
                            load4(tx, kvs, j * dv + c0 + c4 * 4)
                            with T.unroll(0, 4) as i:
                                c = c4 * 4 + i
                                p = ps[j, r]
                                put(acc, tx, (c,), at(acc, tx, c) + p * at(vec, tx, i))

                phases(load_k)
                sync()
                phases(scores)
                sync()
                phases(probabilities)
                sync()
                phases(load_v)
                sync()
                phases(update)

            def _publish_sum(tx):
                T.buffer_store(per_group, at(stat, tx, 1), [tx // bq, tx % bq])

            def _store(tx):
                """The row's sum (over the groups); the thread's columns written once."""
                r, c0 = tx % bq, tx // bq * cg
                row = row0 + r
                put(stat, tx, (1,), zero)
                for k in range(groups):
                    put(stat, tx, (1,), at(stat, tx, 1) + per_group[k, r])
                if empty_rows == "zero":
                    empty = zero
                else:
                    empty = tirx.Select(n > 0, tirx.const(math.nan, f32), zero)
                l_inv = one / at(stat, tx, 1)
                with T.If(row < s):
                    with T.Then():
                        with T.unroll(0, cg // 4) as c4:
                            with T.unroll(0, 4) as i:
                                value = tirx.Select(
                                    at(stat, tx, 0) == neg_inf,
                                    empty,
                                    at(acc, tx, c4 * 4 + i) * l_inv,
                                )
                                put(vec, tx, (i,), value)
                            # 4 words at a time
                            value = at(vec, tx, tirx.Ramp(0, 1, 4)).astype(f"{dtype}x4")
                            column = tirx.Ramp(c0 + c4 * 4, 1, 4)
                            T.buffer_store(o, value, [bb, hh, row, column])

            if serial:
                body()
            else:
                # __launch_bounds__(nt, 1): without the 1, ptxas held the kernel to the 96-128
                # registers of 4-5 blocks an SM with a few bytes of spills (sm_90)
                with (
                    T.thread_binding(0, nt, "threadIdx.x") as tx,
                    T.attr({"tirx.launch_bounds_min_blocks_per_sm": 1}),
                ):
                    cuda_tx = tx
                    body()
    return ib.get()
