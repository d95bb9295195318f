"""One expert per register tile (issue #38, ``transform/_expert_tiles.py``): the layout kernel
that pads each expert's segment of the sorted rows to whole tiles of ``MR`` rows.

Numerical, against numpy on random ids (odd expert counts, row counts on both sides of the
sorted-only threshold ``2 * E * MR``, experts with no row): every padded row reads a row of its
tile's expert, every row lands where it is read (``src[dst[r]] == r``), the tiles stay within
the bound; below the threshold the rows are the sorted rows with their own experts and the
flag set. The kernels that read this layout are checked through FuseGatheredGates
(tests/transform/test_fuse_gathered_gates.py: the numbers of whole MoE blocks against torch on
both sides of the threshold, the rule's unswitched expert select).
"""

import numpy as np
import pytest
import tvm
from tvm import te

from tvm_fusion.transform._expert_tiles import by_rows, kernel_rows, layout_compute, tile_count


def _layout(ids: np.ndarray, experts: int, mr: int):
    rows = len(ids)
    n_tiles = tile_count(rows, experts, mr)
    args = [te.placeholder((rows,), dtype, name) for name, dtype in
            (("ids", "int64"), ("perm", "int32"), ("unsort", "int32"))]  # fmt: skip
    outs = layout_compute(experts, mr, n_tiles, kernel_rows(rows, experts, mr))(*args)
    func = te.create_prim_func([*args, *outs], "int64").with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), "llvm")
    perm = np.argsort(ids, kind="stable").astype("int32")
    unsort = np.argsort(perm).astype("int32")
    values = [tvm.runtime.tensor(a) for a in (ids, perm, unsort)]
    values += [tvm.runtime.tensor(np.full([int(d) for d in o.shape], -7, "int32")) for o in outs]
    lib["main"](*values)
    return n_tiles, *(v.numpy() for v in values[3:])


@pytest.mark.parametrize(
    "rows, experts, mr",
    [(1, 3, 6), (2, 8, 6), (14, 3, 6), (35, 3, 6), (36, 3, 6), (61, 5, 4), (122, 3, 6),
     (200, 8, 6), (97, 7, 3)],
)  # fmt: skip
def test_layout_matches_numpy(rows, experts, mr):
    rng = np.random.default_rng(rows * 31 + experts)
    used = rng.choice(experts, size=max(1, experts - 1), replace=False)  # an expert unused
    ids = rng.choice(used, size=rows).astype("int64")
    n_tiles, src, tiles, per_row, dst = _layout(ids, experts, mr)
    sorted_only = by_rows(rows, experts, mr)
    k_rows = rows if sorted_only else n_tiles * mr  # the kernels' rows
    assert src.shape == (k_rows,) and tiles.shape == (n_tiles,)
    assert per_row.shape == (k_rows + 1,) and dst.shape == (rows,)
    assert ((src >= 0) & (src < rows)).all()
    np.testing.assert_array_equal(src[dst], np.arange(rows))  # each row read where it lands
    assert len(set(dst.tolist())) == rows
    if sorted_only:  # each row its own expert
        assert per_row[-1] == 1 and n_tiles == -(-rows // mr)  # tiles[r // MR] stays in bounds
        np.testing.assert_array_equal(per_row[:-1], ids[src])
        np.testing.assert_array_equal(ids[src], np.sort(ids))
        return
    assert per_row[-1] == 0
    # one expert per tile: every row of tile t, padding and spare tiles included, reads a row
    # of expert tiles[t]
    np.testing.assert_array_equal(ids[src], np.repeat(tiles, mr))
    counts = np.bincount(ids, minlength=experts)
    needed = int(sum(-(-c // mr) for c in counts))
    assert needed <= n_tiles <= min(rows, (rows + experts * (mr - 1)) // mr)
