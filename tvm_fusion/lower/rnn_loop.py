"""One CPU kernel per direction for an ONNX ``LSTM`` / ``GRU`` / ``RNN`` over a dynamic sequence.

``onnx_rnn.py`` unrolls a recurrent op whose step count is known; a symbolic one cannot be
unrolled, so the recurrence becomes one scheduled TIR PrimFunc (``tirx.is_scheduled``: the
schedule rules leave it as written) that ``onnx_rnn`` calls with ``call_tir``:

- inputs: the input projection of every step ``X @ W^T + Wb`` (one GEMM before the kernel, as on the
  static path; seq-major, or batch-major with ``batch_major`` when X comes transposed from (batch,
  seq, features)), the recurrent weight blocked at import as ``(H / V, H, gates, V)`` (a unit
  block's gate columns contiguous per input unit: one vector load per gate and unit, units padded
  with zero columns to whole blocks; V = one vector register of the target's float32 lanes, 8 on
  AVX2, 16 on AVX-512, or 8 below 64 units where that pads less: hidden 24 computes 24 units, not
  32), the recurrent bias ``Rb`` as ``(gates, H_pad)``, the initial states (none when they are
  zeros: ``zero_init`` sets the workspace to zero);
- a serial loop over time; each step runs in parallel over unit blocks on a multi-core target
  once a step has ``PARALLEL_MIN_MACS`` multiply-adds (with a symbolic batch, the kernel holds
  both nests and picks one per call from the batch: under it the threads' sync per step costs
  more than it saves); the parallel nest is one launch of the thread pool for the whole sequence,
  each thread taking its share of a step's unit blocks and waiting at a barrier after each step
  (``pragma_parallel_launch_point`` / ``pragma_parallel_barrier_when_finish``: a launch and join
  per step cost more); per block, a register tile of R batch rows x gates x V units
  accumulates ``h @ R^T`` (R: as many rows, at most 4, as keep the tile, a weight row and a
  broadcast in the target's vector registers: AVX2 LSTM 2, AVX-512 4; the block's weights read
  once per R rows; rows past the batch read a clamped row and are not written), then the gate
  math on the tile (fast polynomial tanh, sigmoid as ``0.5 tanh(x / 2) + 0.5``), writing the new
  state and ``Y[t]``;
- the hidden state ping-pongs between two halves of a ``(2, batch, H_pad)`` workspace (a step
  reads the previous half while other threads write the next one); the LSTM cell state is per
  unit, updated in place; the final states are copied out after the loop (the initial ones when
  the sequence is empty).

Covered: LSTM (ONNX gate order i, o, f, c), GRU with ``linear_before_reset = 1`` (torch's
form: ``r * (h @ R_h^T + Rb_h)`` is per unit), RNN; default activations, ``clip``, forward and
reverse. Not covered (``onnx_rnn`` refuses them in one line on a dynamic sequence): GRU with
``linear_before_reset = 0`` (its candidate GEMM reads ``r * h`` of every unit: a second
parallel phase per step), peepholes, ``input_forget``, ``sequence_lens``, other activations,
non-constant ``R`` / ``B``, dtypes other than float32. The kernel is CPU code (parallel and
vector loops, no GPU thread bindings).
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from .. import target as _target

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
LANES = 16  # units per block where no target says more: one AVX-512 float32 vector
SMALL_LANES = 8  # units per block of a small hidden size that wider blocks would pad
SMALL_HIDDEN = 64  # hidden sizes below this may take 8-unit blocks
ROWS = 4  # most batch rows per register tile
PARALLEL_MIN_MACS = 1 << 19  # multiply-adds per step (all batch rows) below which it is serial
# the attribute of a private Relax function that holds one direction of a recurrence over a static
# sequence, unrolled (frontend/onnx_rnn.py, frontend/torch_rnn.py): (proj, R, [Rb], [h0, c0]) ->
# (Y, h_T[, c_T]); its value: kind, hidden, reverse, zero_init, batch_major, bias[, clip].
# transform/choose_recurrence.py makes the call this loop kernel on CPU, inlines it elsewhere
RECURRENCE_ATTR = "tvm_fusion.recurrence"

# Eigen's rational tanh (TVM's topi.fast_tanh): x clamped to [-9, 9]
_TANH_P = (
    -2.76076847742355e-16,
    2.00018790482477e-13,
    -8.60467152213735e-11,
    5.12229709037114e-08,
    1.48572235717979e-05,
    6.37261928875436e-04,
    4.89352455891786e-03,
)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)


def _let(value, body):
    """``body(v)`` with ``v`` bound once to ``value`` (no copies of a long expression)."""
    var = tirx.Var("t", "float32")
    return tirx.Let(var, value, body(var))


def _tanh(x):
    def poly(x):
        x2 = x * x
        p = T.float32(_TANH_P[0])
        for c in _TANH_P[1:]:
            p = x2 * p + T.float32(c)
        q = T.float32(_TANH_Q[0])
        for c in _TANH_Q[1:]:
            q = x2 * q + T.float32(c)
        return x * p / q

    return _let(T.max(T.min(x, T.float32(9.0)), T.float32(-9.0)), poly)


def _sigmoid(x):
    return T.float32(0.5) * _tanh(T.float32(0.5) * x) + T.float32(0.5)


def vector_of(target=None) -> int:
    """float32 lanes of one vector register of ``target`` (the current target, else this
    machine's, when None: the ONNX importer's dynamic path does not know the target; the
    kernel is CPU code)."""
    return _target.vector_lanes(_cpu_target(target))


def _cpu_target(target):
    if target is None:
        target = tvm.target.Target.current(allow_none=True)
    return _target.host_target() if target is None else _target.parse_target(target)


def lanes_for(hidden: int, vector: int = LANES) -> int:
    """Units per block: one ``vector`` of float32 lanes, or 8 for a small hidden size that
    8-unit blocks pad less than wider ones (24 of 16-lane blocks: 24 units computed, not 32)."""
    if (
        vector > SMALL_LANES
        and hidden < SMALL_HIDDEN
        and -(-hidden // SMALL_LANES) * SMALL_LANES < -(-hidden // vector) * vector
    ):
        return SMALL_LANES
    return vector


def tile_rows(kind: str, lanes: int, vector: int, registers: int) -> int:
    """Batch rows per register tile: as many (at most ``ROWS``) as keep the tile's
    accumulators (rows x gates x the block's vectors), one vector per gate of the weight row
    and the broadcast state in ``registers`` vector registers (AVX2's 16 ymm, LSTM: 2 rows;
    AVX-512's 32 zmm: 4); a spilled tile ran at half speed."""
    per_row = GATES[kind] * -(-lanes // vector)
    return max(1, min(ROWS, (registers - 1 - per_row) // per_row))


def parallel_mode(kind: str, hidden: int, cores: int) -> str:
    """How a step's unit blocks run: ``serial`` on one core; ``parallel`` when one batch row's
    step already has ``PARALLEL_MIN_MACS`` multiply-adds; else ``by_batch``, chosen per call
    from the batch (a parallel launch and join per step costs more than a small step saves)."""
    if cores <= 1:
        return "serial"
    return "parallel" if GATES[kind] * hidden * hidden >= PARALLEL_MIN_MACS else "by_batch"


def block_weight(r: np.ndarray, gates: int, vector: int = LANES) -> np.ndarray:
    """``R`` (gates * H, H) -> (H_pad / V, H, gates, V), padded units zero (V:
    :func:`lanes_for` of ``vector``)."""
    hidden = r.shape[1]
    lanes = lanes_for(hidden, vector)
    blocks = -(-hidden // lanes)
    padded = np.zeros((gates, blocks * lanes, hidden), r.dtype)
    padded[:, :hidden] = r.reshape(gates, hidden, hidden)
    return np.ascontiguousarray(padded.reshape(gates, blocks, lanes, hidden).transpose(1, 3, 0, 2))


def block_bias(rb: np.ndarray | None, gates: int, hidden: int, vector: int = LANES) -> np.ndarray:
    """``Rb`` (gates * H) -> (gates, H_pad), zeros where absent."""
    lanes = lanes_for(hidden, vector)
    blocks = -(-hidden // lanes)
    out = np.zeros((gates, blocks * lanes), "float32")
    if rb is not None:
        out[:, :hidden] = rb.reshape(gates, hidden)
    return out


def _without_initial_states(func: tirx.PrimFunc, states: int) -> tirx.PrimFunc:
    """``func`` without its initial-state parameters (after proj, w, b), which its body, built
    with ``zero_init``, does not read."""
    params = list(func.params)
    return tirx.PrimFunc(params[:3] + params[3 + states :], func.body, func.ret_type, func.attrs)


def _at(proj, t, n, c, batch_major: bool):
    """``proj[t, n, c]`` of a (seq, batch, width) projection, or of a (batch, seq, width) one."""
    return proj[n, t, c] if batch_major else proj[t, n, c]


def loop_kernel(
    kind: str,
    hidden: int,
    reverse: bool,
    clip: float | None,
    zero_init: bool = False,
    batch_major: bool = False,
    target=None,
) -> tirx.PrimFunc:
    """:func:`_loop_kernel` for ``target`` (None: :func:`vector_of`'s), parsed once per
    distinct arguments (TVMScript's parser takes about 0.7 s a kernel; a model's layers and
    directions share theirs)."""
    clip = None if clip is None else float(clip)
    tgt = _cpu_target(target)
    vector = _target.vector_lanes(tgt)
    lanes = lanes_for(int(hidden), vector)
    rows = tile_rows(str(kind), lanes, vector, _target.vector_registers(tgt))
    # one unit block: nothing to share (and the launch point of a parallel loop of extent 1,
    # which the simplifier drops, fails LowerIntrin: "Cannot find parallel loop")
    cores = _target.num_cores(tgt) if -(-int(hidden) // lanes) > 1 else 1
    mode = parallel_mode(str(kind), int(hidden), cores)
    # by_batch: in parallel when the call's batch gives a step PARALLEL_MIN_MACS multiply-adds
    min_rows = (
        -(-PARALLEL_MIN_MACS // (GATES[kind] * int(hidden) ** 2)) if mode == "by_batch" else 0
    )
    return _loop_kernel(str(kind), int(hidden), bool(reverse), clip, bool(zero_init),
                        bool(batch_major), lanes, rows, mode, min_rows)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _loop_kernel(
    kind: str,
    hidden: int,
    reverse: bool,
    clip: float | None,
    zero_init: bool,
    batch_major: bool,
    lanes: int,
    rows: int,
    mode: str,
    min_rows: int,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc of one direction: (proj, w, b, h0[, c0]) -> (y, h_T[, c_T]);
    with ``zero_init`` (proj, w, b) -> (y, h_T[, c_T]), the initial states zeros. ``proj`` is
    (seq, batch, gates * H), or (batch, seq, gates * H) with ``batch_major``. Blocks of
    ``lanes`` units, tiles of ``rows`` batch rows, a step's blocks run as ``mode`` says
    (:func:`parallel_mode`; ``by_batch``: in parallel from ``min_rows`` batch rows on)."""
    gates = GATES[kind]
    blocks = -(-hidden // lanes)
    padded, width = blocks * lanes, gates * hidden
    rev = int(reverse)

    def clipped(x):
        if clip is None:
            return x
        return T.max(T.min(x, T.float32(clip)), T.float32(-clip))

    def gate_in(proj, s, seq, n, g, jb, v):
        """The input projection of gate ``g`` at step ``s`` (time reversed in a reverse
        direction), row ``n``, unit ``jb * lanes + v`` (clamped into the projection)."""
        unit = jb * lanes + v if g == 0 else g * hidden + jb * lanes + v
        return _at(proj, s + rev * (seq - 1 - 2 * s), n, T.min(unit, width - 1), batch_major)

    @T.macro
    def accumulate(acc, w, b, hs, s, batch, bo, jb):
        """``acc`` (rows, gates, lanes) = ``Rb`` + the previous hidden state of rows ``bo *
        rows ...`` (the rows past the batch read its last row) times the unit block ``jb`` of
        the blocked weight."""
        for r, g, v in T.grid(rows, gates, lanes):
            acc[r, g, v] = b[g, jb * lanes + v]
        for k in range(hidden):
            for r in T.unroll(rows):
                for g in T.unroll(gates):
                    for v in T.vectorized(lanes):
                        acc[r, g, v] = (
                            acc[r, g, v]
                            + hs[s % 2, T.min(bo * rows + r, batch - 1), k] * w[jb, k, g, v]
                        )

    @T.macro
    def store_y(y, hs, s, seq, n, jb):
        """``Y`` of step ``s`` (time reversed in a reverse direction), row ``n``, unit block
        ``jb``: the new hidden state; the units past ``hidden`` of the last block not written."""
        if hidden % lanes == 0:  # whole blocks: one vector store
            for v in T.vectorized(lanes):
                y[s + rev * (seq - 1 - 2 * s), n, jb * lanes + v] = hs[
                    (s + 1) % 2, n, jb * lanes + v
                ]
        else:
            for v in range(lanes):
                if jb * lanes + v < hidden:
                    y[s + rev * (seq - 1 - 2 * s), n, jb * lanes + v] = hs[
                        (s + 1) % 2, n, jb * lanes + v
                    ]

    if kind == "LSTM":

        @T.macro
        def lstm_block(proj, w, b, hs, cs, y, s, seq, batch, jb):
            """Step ``s`` of the unit block ``jb``: every tile of batch rows."""
            for bo in range((batch + rows - 1) // rows):
                acc = T.decl_buffer((rows, gates, lanes), "float32", scope="local")
                accumulate(acc, w, b, hs, s, batch, bo, jb)
                for r in range(rows):
                    if bo * rows + r < batch:
                        for v in T.vectorized(lanes):
                            cs[bo * rows + r, jb * lanes + v] = _sigmoid(
                                clipped(
                                    acc[r, 2, v] + gate_in(proj, s, seq, bo * rows + r, 2, jb, v)
                                )
                            ) * cs[bo * rows + r, jb * lanes + v] + _sigmoid(
                                clipped(
                                    acc[r, 0, v] + gate_in(proj, s, seq, bo * rows + r, 0, jb, v)
                                )
                            ) * _tanh(
                                clipped(
                                    acc[r, 3, v] + gate_in(proj, s, seq, bo * rows + r, 3, jb, v)
                                )
                            )
                            hs[(s + 1) % 2, bo * rows + r, jb * lanes + v] = _sigmoid(
                                clipped(
                                    acc[r, 1, v] + gate_in(proj, s, seq, bo * rows + r, 1, jb, v)
                                )
                            ) * _tanh(cs[bo * rows + r, jb * lanes + v])
                        store_y(y, hs, s, seq, bo * rows + r, jb)

        @T.macro
        def lstm_steps(proj, w, b, hs, cs, y, seq, batch, par):
            """Every step; a step's unit blocks in parallel with ``par``."""
            if par:
                with T.attr(0, "pragma_parallel_launch_point", 1):
                    for s in range(seq):
                        with T.attr(0, "pragma_parallel_barrier_when_finish", 1):
                            for jb in T.parallel(blocks):
                                lstm_block(proj, w, b, hs, cs, y, s, seq, batch, jb)
            else:
                for s in range(seq):
                    for jb in range(blocks):
                        lstm_block(proj, w, b, hs, cs, y, s, seq, batch, jb)

        @T.prim_func(private=True, s_tir=True)
        def lstm_loop(
            p_proj: T.handle,
            p_w: T.handle,
            p_b: T.handle,
            p_h0: T.handle,
            p_c0: T.handle,
            p_y: T.handle,
            p_ht: T.handle,
            p_ct: T.handle,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
            seq = T.int64()
            batch = T.int64()
            steps_or_rows = T.int64()
            rows_or_steps = T.int64()
            proj = T.match_buffer(p_proj, (steps_or_rows, rows_or_steps, width))
            w = T.match_buffer(p_w, (blocks, hidden, gates, lanes))
            b = T.match_buffer(p_b, (gates, padded))
            h0 = T.match_buffer(p_h0, (batch, hidden))
            c0 = T.match_buffer(p_c0, (batch, hidden))
            y = T.match_buffer(p_y, (seq, batch, hidden))
            ht = T.match_buffer(p_ht, (batch, hidden))
            ct = T.match_buffer(p_ct, (batch, hidden))
            hs = T.alloc_buffer((2, batch, padded))
            cs = T.alloc_buffer((batch, padded))
            for n, j in T.grid(batch, padded):
                if zero_init:
                    hs[0, n, j] = T.float32(0)
                    cs[n, j] = T.float32(0)
                else:
                    hs[0, n, j] = T.if_then_else(
                        j < hidden, h0[n, T.min(j, hidden - 1)], T.float32(0)
                    )
                    cs[n, j] = T.if_then_else(j < hidden, c0[n, T.min(j, hidden - 1)], T.float32(0))
            if mode == "by_batch":
                if batch >= min_rows:
                    lstm_steps(proj, w, b, hs, cs, y, seq, batch, True)
                else:
                    lstm_steps(proj, w, b, hs, cs, y, seq, batch, False)
            else:
                lstm_steps(proj, w, b, hs, cs, y, seq, batch, mode == "parallel")
            for n, j in T.grid(batch, hidden):
                ht[n, j] = hs[seq % 2, n, j]
                ct[n, j] = cs[n, j]

        return _without_initial_states(lstm_loop, 2) if zero_init else lstm_loop

    if kind == "GRU":

        @T.macro
        def gru_block(proj, w, b, hs, gz, y, s, seq, batch, jb):
            """Step ``s`` of the unit block ``jb``: every tile of batch rows."""
            for bo in range((batch + rows - 1) // rows):
                acc = T.decl_buffer((rows, gates, lanes), "float32", scope="local")
                accumulate(acc, w, b, hs, s, batch, bo, jb)
                for r in range(rows):
                    if bo * rows + r < batch:
                        for v in T.vectorized(lanes):
                            # ONNX order z, r, h; z kept in gz for the update below
                            gz[bo * rows + r, jb * lanes + v] = _sigmoid(
                                clipped(
                                    acc[r, 0, v] + gate_in(proj, s, seq, bo * rows + r, 0, jb, v)
                                )
                            )
                            hs[(s + 1) % 2, bo * rows + r, jb * lanes + v] = (
                                T.float32(1) - gz[bo * rows + r, jb * lanes + v]
                            ) * _tanh(
                                clipped(
                                    gate_in(proj, s, seq, bo * rows + r, 2, jb, v)
                                    + _sigmoid(
                                        clipped(
                                            acc[r, 1, v]
                                            + gate_in(proj, s, seq, bo * rows + r, 1, jb, v)
                                        )
                                    )
                                    * acc[r, 2, v]
                                )
                            ) + gz[bo * rows + r, jb * lanes + v] * hs[
                                s % 2, bo * rows + r, jb * lanes + v
                            ]
                        store_y(y, hs, s, seq, bo * rows + r, jb)

        @T.macro
        def gru_steps(proj, w, b, hs, gz, y, seq, batch, par):
            """Every step; a step's unit blocks in parallel with ``par``."""
            if par:
                with T.attr(0, "pragma_parallel_launch_point", 1):
                    for s in range(seq):
                        with T.attr(0, "pragma_parallel_barrier_when_finish", 1):
                            for jb in T.parallel(blocks):
                                gru_block(proj, w, b, hs, gz, y, s, seq, batch, jb)
            else:
                for s in range(seq):
                    for jb in range(blocks):
                        gru_block(proj, w, b, hs, gz, y, s, seq, batch, jb)

        @T.prim_func(private=True, s_tir=True)
        def gru_loop(
            p_proj: T.handle,
            p_w: T.handle,
            p_b: T.handle,
            p_h0: T.handle,
            p_y: T.handle,
            p_ht: T.handle,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
            seq = T.int64()
            batch = T.int64()
            steps_or_rows = T.int64()
            rows_or_steps = T.int64()
            proj = T.match_buffer(p_proj, (steps_or_rows, rows_or_steps, width))
            w = T.match_buffer(p_w, (blocks, hidden, gates, lanes))
            b = T.match_buffer(p_b, (gates, padded))
            h0 = T.match_buffer(p_h0, (batch, hidden))
            y = T.match_buffer(p_y, (seq, batch, hidden))
            ht = T.match_buffer(p_ht, (batch, hidden))
            hs = T.alloc_buffer((2, batch, padded))
            gz = T.alloc_buffer((batch, padded))
            for n, j in T.grid(batch, padded):
                if zero_init:
                    hs[0, n, j] = T.float32(0)
                else:
                    hs[0, n, j] = T.if_then_else(
                        j < hidden, h0[n, T.min(j, hidden - 1)], T.float32(0)
                    )
            if mode == "by_batch":
                if batch >= min_rows:
                    gru_steps(proj, w, b, hs, gz, y, seq, batch, True)
                else:
                    gru_steps(proj, w, b, hs, gz, y, seq, batch, False)
            else:
                gru_steps(proj, w, b, hs, gz, y, seq, batch, mode == "parallel")
            for n, j in T.grid(batch, hidden):
                ht[n, j] = hs[seq % 2, n, j]

        return _without_initial_states(gru_loop, 1) if zero_init else gru_loop

    @T.macro
    def rnn_block(proj, w, b, hs, y, s, seq, batch, jb):
        """Step ``s`` of the unit block ``jb``: every tile of batch rows."""
        for bo in range((batch + rows - 1) // rows):
            acc = T.decl_buffer((rows, gates, lanes), "float32", scope="local")
            accumulate(acc, w, b, hs, s, batch, bo, jb)
            for r in range(rows):
                if bo * rows + r < batch:
                    for v in T.vectorized(lanes):
                        hs[(s + 1) % 2, bo * rows + r, jb * lanes + v] = _tanh(
                            clipped(acc[r, 0, v] + gate_in(proj, s, seq, bo * rows + r, 0, jb, v))
                        )
                    store_y(y, hs, s, seq, bo * rows + r, jb)

    @T.macro
    def rnn_steps(proj, w, b, hs, y, seq, batch, par):
        """Every step; a step's unit blocks in parallel with ``par``."""
        if par:
            with T.attr(0, "pragma_parallel_launch_point", 1):
                for s in range(seq):
                    with T.attr(0, "pragma_parallel_barrier_when_finish", 1):
                        for jb in T.parallel(blocks):
                            rnn_block(proj, w, b, hs, y, s, seq, batch, jb)
        else:
            for s in range(seq):
                for jb in range(blocks):
                    rnn_block(proj, w, b, hs, y, s, seq, batch, jb)

    @T.prim_func(private=True, s_tir=True)
    def rnn_loop(
        p_proj: T.handle,
        p_w: T.handle,
        p_b: T.handle,
        p_h0: T.handle,
        p_y: T.handle,
        p_ht: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        seq = T.int64()
        batch = T.int64()
        steps_or_rows = T.int64()
        rows_or_steps = T.int64()
        proj = T.match_buffer(p_proj, (steps_or_rows, rows_or_steps, width))
        w = T.match_buffer(p_w, (blocks, hidden, gates, lanes))
        b = T.match_buffer(p_b, (gates, padded))
        h0 = T.match_buffer(p_h0, (batch, hidden))
        y = T.match_buffer(p_y, (seq, batch, hidden))
        ht = T.match_buffer(p_ht, (batch, hidden))
        hs = T.alloc_buffer((2, batch, padded))
        for n, j in T.grid(batch, padded):
            if zero_init:
                hs[0, n, j] = T.float32(0)
            else:
                hs[0, n, j] = T.if_then_else(j < hidden, h0[n, T.min(j, hidden - 1)], T.float32(0))
        if mode == "by_batch":
            if batch >= min_rows:
                rnn_steps(proj, w, b, hs, y, seq, batch, True)
            else:
                rnn_steps(proj, w, b, hs, y, seq, batch, False)
        else:
            rnn_steps(proj, w, b, hs, y, seq, batch, mode == "parallel")
        for n, j in T.grid(batch, hidden):
            ht[n, j] = hs[seq % 2, n, j]

    return _without_initial_states(rnn_loop, 1) if zero_init else rnn_loop


def loop_call(
    add_func, spec, proj: relax.Expr, r: np.ndarray, rb: np.ndarray | None, states, target=None
):
    """``call_tir`` of the loop kernel of one direction described by ``spec`` (the mapping of
    ``RECURRENCE_ATTR``: kind, hidden, reverse, zero_init, batch_major[, clip]) on the
    projection ``proj``, the recurrent weight ``r`` (gates * H, H), bias ``rb`` (gates * H) or
    None, and the initial ``states`` (none with zero_init), built for ``target`` (None: see
    :func:`vector_of`); ``add_func(func, name)`` adds the kernel to the module and returns its
    GlobalVar. Returns (Y, h_T[, c_T])."""
    kind, hidden = str(spec["kind"]), int(spec["hidden"])
    batch_major, zero_init = bool(spec["batch_major"]), bool(spec["zero_init"])
    clip = float(spec["clip"]) if "clip" in spec else None
    gates = GATES[kind]
    tgt = _cpu_target(target)
    kernel = loop_kernel(kind, hidden, bool(spec["reverse"]), clip, zero_init, batch_major, tgt)
    gv = add_func(kernel, f"{kind.lower()}_loop")
    vector = _target.vector_lanes(tgt)
    args = [
        proj,
        relax.const(block_weight(r, gates, vector)),
        relax.const(block_bias(rb, gates, hidden, vector)),
    ]
    dims = list(proj.ty.shape.values)
    seq, batch = (dims[1], dims[0]) if batch_major else (dims[0], dims[1])
    dtype = str(proj.ty.dtype)
    state = relax.TensorType([batch, hidden], dtype)
    out = [relax.TensorType([seq, batch, hidden], dtype), state]
    if kind == "LSTM":
        out.append(state)
    return relax.call_tir(gv, args + list(states), out)
