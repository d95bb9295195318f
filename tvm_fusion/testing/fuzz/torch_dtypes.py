"""The torch.export fuzzer's ``dtypes`` family, ``_dtypes(rng) -> Spec`` (torch only, not in the
ONNX fuzzer):

- ``dtypes``: integer, boolean and mixed-float
  arithmetic as models write it, on a float (b, s, h) input, int64 / int32 ids in
  [-scale, scale] and a 0 / 1 mask (int64, int32, bool or float32; each row's first 1), and
  a float16 / float32 input for the mixed chains: T5's and DeBERTa-v2's relative-position
  buckets (abs, sign, log, ceil, ``.to(long)``, ``min``, ``where``; bucket parameters whose
  boundaries are no exact floats), a mask made a float bias (``(1 - mask) * -1e4``,
  ``finfo.min``, ``masked_fill``, ``~mask.bool()``, ``where``), index arithmetic (``//``,
  ``%``, ``div`` with a rounding mode, ``remainder`` / ``fmod``, ``int / k``, ``int * 0.5``),
  position ids (RoBERTa's ``cumsum(mask) * mask``, ``arange * k``, ``pid / s``), float16 with
  float32 / int / mask operands, 0-dim tensors of another dtype (``torch.tensor(0.5,
  dtype=float64)``), ``sum`` / ``mean`` of bool / int (with ``dtype=``), and comparisons of
  int / bool tensors with floats (``ids < 2.5``, ``x[..., -1]``, ``maximum(int, float)``).
"""

from __future__ import annotations

from .torch_spec import Input, Spec, _choice, _dim, _module, _param

# position-bucket parameters (num_buckets, m): T5's max_distance m - 1 and DeBERTa's
# max_position - 1 are primes above any |relative position| fed, so no bucket boundary is an
# exact float (torch and we may round a log by one ulp differently there: neighbouring buckets)
_BUCKETS = ((6, 98), (8, 102), (10, 128), (12, 132))
_COMPARES = (
    lambda a, b: a > b,
    lambda a, b: a < b,
    lambda a, b: a >= b,
    lambda a, b: a <= b,
    lambda a, b: a == b,
    lambda a, b: a != b,
)
_BOUNDS = (2.5, -0.5, 0.5, 2.0, -3.0, 1)
DTYPE_CHAINS = (
    "t5_buckets",
    "deberta_buckets",
    "mask_bias",
    "index_math",
    "positions",
    "mixed_float",
    "zero_dim",
    "reductions",
    "compare",
    "misc",
)


def _t5_bucket(torch, rel, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's ``_relative_position_bucket`` as HF writes it."""
    import math

    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    exact = num_buckets // 2
    small = rel < exact
    large = exact + (
        torch.log(rel.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(small, rel, large)


def _deberta_bucket(torch, rel, bucket_size: int, max_position: int):
    """DeBERTa-v2's ``make_log_bucket_position``."""
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (rel < mid) & (rel > -mid), torch.tensor(mid - 1).type_as(rel), torch.abs(rel)
    )
    log_pos = (
        torch.ceil(
            torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return torch.where(abs_pos <= mid, rel.type_as(log_pos), log_pos * sign)


def _dtypes(rng) -> Spec:
    """Integer, boolean and mixed-float arithmetic as models write it (see the docstring)."""
    import torch
    import torch.nn.functional as F

    b, s = _dim(rng, "b", 0.4), _dim(rng, "s", 0.3)
    h = int(_choice(rng, [1, 3, 4, 5, 8]))
    chains = [str(c) for c in rng.choice(DTYPE_CHAINS, size=int(rng.integers(1, 4)), replace=False)]
    mask_dtype = _choice(rng, ["int64", "int64", "int32", "bool", "float32"])
    ids_dtype = _choice(rng, ["int64", "int64", "int32"])
    inputs = [
        Input([b, s, h]),
        Input([b, s], kind="int", scale=int(_choice(rng, [3, 7, 40])), dtype=ids_dtype),
        Input([b, s], kind="mask", dtype=mask_dtype),
    ]
    half = "mixed_float" in chains or "zero_dim" in chains
    if half:
        inputs.append(Input([b, s, h], dtype=_choice(rng, ["float16", "float32"])))
    nb, maxd = _BUCKETS[int(rng.integers(len(_BUCKETS)))]
    kids = {"table": _param(nb, h)}
    bidirectional = bool(rng.random() < 0.6)
    k = int(_choice(rng, [2, 3, 4, 7]))
    picks = {c: int(rng.integers(1 << 20)) for c in chains}  # each chain's own choices
    scalar = float(_choice(rng, [0.5, -1e4, 2.0, -0.25]))
    neg = float(_choice(rng, [-1e4, -1e9, float(torch.finfo(torch.float32).min)]))

    def pick(chain: str, i: int, n: int) -> int:
        return (picks[chain] >> (3 * i)) % n

    def fwd(mod, x, ids, mask, *rest):
        ns = x.shape[1]
        outs = []
        for chain in chains:
            p = lambda i, n, c=chain: pick(c, i, n)  # noqa: E731
            if chain == "t5_buckets":
                pos = torch.arange(ns, dtype=torch.long, device=x.device)
                rel = pos[None, :] - pos[:, None]
                bk = _t5_bucket(torch, rel, nb, maxd - 1, bidirectional)
                outs.append(bk)
                outs.append(F.embedding(bk, mod.table).permute(2, 0, 1).unsqueeze(0))
            elif chain == "deberta_buckets":
                pos = torch.arange(ns, device=x.device) if p(0, 2) else ids[0].long()
                rel = pos[:, None] - pos[None, :]
                bk = _deberta_bucket(torch, rel, nb, maxd)
                outs.append(bk)
                idx = torch.clamp(bk.long() + nb // 2, 0, nb - 1)
                outs.append(mod.table[idx] * 0.5)
            elif chain == "mask_bias":
                scores = torch.einsum("bsh,bth->bst", x, x)
                how = p(0, 6)
                if how == 0:
                    m = mask.long() if mask.dtype == torch.bool else mask
                    bias = (1 - m[:, None, :]) * neg
                elif how == 1:
                    bias = (1.0 - mask.float()[:, None, :]) * torch.finfo(torch.float32).min
                elif how == 2:
                    bias = torch.zeros_like(scores).masked_fill(mask[:, None, :] == 0, neg)
                elif how == 3:
                    bias = (~mask.bool())[:, None, :] * neg
                elif how == 4:
                    keep = mask.bool()[:, None, :]
                    scores = torch.where(keep, scores, torch.tensor(neg, dtype=scores.dtype))
                    bias = torch.zeros((), dtype=torch.float32)
                else:
                    bias = mask.to(x.dtype)[:, None, :].logical_not() * scalar
                y = scores + bias
                outs.append(torch.softmax(y, -1) if p(1, 2) else y)
            elif chain == "index_math":
                v = ids if p(0, 2) else ids.to(torch.int32)
                outs.append(v // k)
                outs.append(v % k)
                outs.append(torch.div(v, k, rounding_mode="floor" if p(1, 2) else "trunc"))
                outs.append(torch.remainder(v, -k) if p(2, 2) else torch.fmod(v, k))
                outs.append(v / k if p(3, 2) else v * scalar)
                outs.append((v + 0.5) // 2 if p(4, 2) else v // (mask.long().abs() + 1))
            elif chain == "positions":
                m = mask.long() if mask.dtype != torch.bool else mask.int()
                if p(0, 2):  # RoBERTa's create_position_ids_from_input_ids
                    pid = (torch.cumsum(m, dim=1).type_as(m) * m).long() + 1
                else:
                    pid = torch.cumsum(m, dim=-1) - 1
                    pid = pid.masked_fill(m == 0, 1)
                outs.append(pid)
                ar = torch.arange(ns, device=x.device)
                outs.append(ar * k if p(1, 2) else ar * scalar)
                outs.append(x + (pid.to(x.dtype) / ns).unsqueeze(-1))
            elif chain == "mixed_float":
                z = rest[0]
                outs.append(z + x)
                outs.append(z * scalar if p(0, 2) else z.float() * 2)
                outs.append((x.half() * 0.5 if p(1, 2) else x.to(z.dtype)) + z)
                outs.append((z * mask.unsqueeze(-1)) if p(2, 2) else z + ids.unsqueeze(-1))
            elif chain == "zero_dim":
                z = rest[0]
                c64 = torch.tensor(scalar, dtype=torch.float64)
                outs.append(ids * c64)  # an integer tensor times a float64 0-dim: float64
                outs.append(z * c64)  # a float tensor times a float64 0-dim: z's dtype
                ci = torch.tensor(k, dtype=torch.int64)
                outs.append(x * ci if p(0, 2) else mask + ci)
                outs.append(ids.float() + torch.tensor(1, dtype=torch.int32))
            elif chain == "reductions":
                outs.append(mask.sum(-1))
                outs.append(mask.bool().sum(dim=1))
                outs.append(mask.sum(dim=1, dtype=torch.float32))
                outs.append(ids.mean(-1, dtype=torch.float32) if p(0, 2) else mask.float().mean(1))
                outs.append(ids.ne(0).sum(-1) - 1)
                outs.append((x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
            elif chain == "compare":
                cmp = _COMPARES[p(2, len(_COMPARES))]
                bound = _BOUNDS[p(3, len(_BOUNDS))]
                outs.append(cmp(ids, bound))
                outs.append(ids.float() < x[..., 0])
                outs.append(torch.where(cmp(ids, -bound), x[..., 0], 0.0))
                outs.append(cmp(mask, 0.5) if p(4, 2) else cmp(mask.bool(), bound))
                outs.append(torch.maximum(ids, x[..., -1]) if p(0, 2) else torch.clamp(ids, -2, 5))
                outs.append(torch.min(ids, torch.full_like(ids, k)))
                outs.append((ids == mask) if p(1, 2) else (ids >= mask.float() * 2))
            elif chain == "misc":
                keep = mask.bool()
                outs.append(torch.clamp(ids, min=0.5) if p(0, 2) else ids.clamp(max=k))
                outs.append(torch.cumsum(keep, 1) if p(1, 2) else torch.cumsum(ids, -1))
                outs.append(torch.where(keep, ids, 0.5) if p(2, 2) else torch.where(keep, 1, 0.0))
                outs.append(torch.sign(ids) * torch.abs(ids) + ids**2)
                outs.append(ids.to(torch.float16) * 0.5 if p(3, 2) else keep * 1.5)
                outs.append(2 ** ids.clamp(0, 8) if p(4, 2) else x.argmax(-1) + ids)
        return tuple(outs)

    note = f"{' '.join(chains)} on ({b}, {s}, {h}), ids {ids_dtype}, mask {mask_dtype}"
    if half:
        note += f", z {inputs[3].dtype}"
    return Spec(_module(fwd, **kids), inputs, note, rng.random() < 0.7)
