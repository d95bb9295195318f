"""FuseAttention on CPU reads Q and K^T through the transposes of heads that make them, with
the scalar constants that scale them folded into the kernel's scale (a GPT block: fused qkv
Linear, split, ``view(b, s, h, dh).transpose(1, 2)``, SDPA): no copy kernel for Q or K^T.
Numbers against torch at sequence lengths 7 and 33 (tails of the kernel's tiles and key
blocks) and a symbolic sequence; the kernel's layouts against numpy at 70 (a whole key block
packed from K's rows)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

from tvm_fusion.frontend import import_exported_program
from tvm_fusion.lower.attention import attention_kernel
from tvm_fusion.transform import FuseAttention, collect_rewrites, fuse_attention

LLVM = tvm.target.Target({"kind": "llvm"})
HIDDEN, HEADS = 16, 2


@pytest.fixture(autouse=True)
def _no_size_gate(monkeypatch):
    monkeypatch.setattr(fuse_attention, "MIN_STATIC_SCORES", 0)


class _Heads(torch.nn.Module):
    """A GPT block's attention: fused qkv Linear, split, heads, SDPA, heads merged."""

    def __init__(self, causal):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.causal = causal

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return a.transpose(1, 2).reshape(b, s, d)


def _kernel_args(mod):
    """The kernel's Q argument and the ops that bind its Q and K^T arguments in main."""
    main = mod["main"]
    bound = {}
    call = None
    for block in main.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
            value = binding.value
            if isinstance(value, relax.Call) and value.op.name == "relax.call_tir":
                if value.args[0].name_hint == "fused_attention":
                    call = value
    assert call is not None
    ops = [
        bound[a].op.name if isinstance(bound.get(a), relax.Call) else None
        for a in call.args[1].fields[:2]
    ]
    return call.args[1].fields[0], ops


def _check(module, x, dynamic=None):
    torch.manual_seed(0)
    ep = torch.export.export(module, (x,), dynamic_shapes=dynamic)
    mod = import_exported_program(ep)
    with collect_rewrites() as counts:
        after = FuseAttention(LLVM)(mod)
    assert counts["FuseAttention"] == 1
    q, ops = _kernel_args(after)
    # Q and K^T are the (b, s, heads, dh) views of the split, not transposes of them
    assert "relax.permute_dims" not in ops and "relax.multiply" not in ops, ops
    q_shape = q.ty.shape.values
    assert int(q_shape[2]) == HEADS and int(q_shape[3]) == HIDDEN // HEADS, q_shape
    return mod


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [7, 33])
def test_gpt_heads_read_in_place(causal, s):
    module = _Heads(causal).eval()
    x = torch.randn(2, s, HIDDEN)
    mod = _check(module, x)
    ex = tvm.compile(mod, LLVM, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x.numpy()))
    out = out if hasattr(out, "numpy") else out[0]
    with torch.no_grad():
        ref = module(x).numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_gpt_heads_symbolic_sequence():
    module = _Heads(True).eval()
    seq = torch.export.Dim("seq", min=2, max=256)
    mod = _check(module, torch.randn(2, 9, HIDDEN), dynamic=({1: seq},))
    ex = tvm.compile(mod, LLVM, relax_pipeline="tvm_fusion")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    for s in (2, 7, 33, 70):
        x = torch.randn(2, s, HIDDEN)
        out = vm["main"](tvm.runtime.tensor(x.numpy()))
        out = out if hasattr(out, "numpy") else out[0]
        with torch.no_grad():
            ref = module(x).numpy()
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "k_layout", [(0, 2, 3, 1), (0, 1, 3, 2), (0, 1, 2, 3)], ids=["bnhd", "bhnd", "bhdn"]
)
@pytest.mark.parametrize("s", [7, 70])
def test_kernel_layouts(k_layout, s):
    """Q given as (B, S, H, D), K^T as K (B, N, H, D), K (B, H, N, D) or K^T itself, V as it
    is: causal numbers against numpy."""
    b, h, d = 2, 3, 8
    rng = np.random.default_rng(s)
    q, k, v = (rng.standard_normal((b, h, s, d)).astype("float32") for _ in range(3))
    kt = k.transpose(0, 1, 3, 2)
    # the kernel's operand x is permute_dims(buffer, axes): buffer = x transposed by argsort
    q_buf = np.ascontiguousarray(q.transpose(np.argsort((0, 2, 1, 3))))
    k_buf = np.ascontiguousarray(kt.transpose(np.argsort(k_layout)))
    keep = np.tril(np.ones((s, s), bool))
    kernel = attention_kernel(
        d,
        d,
        0.5,
        (False, False, True, True),
        where_fill=(float("-inf"), True),
        layouts=((0, 2, 1, 3), k_layout, (0, 1, 2, 3)),
    )
    lib = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), LLVM)
    args = [q_buf, k_buf, v, keep.reshape(1, 1, s, s), np.zeros_like(q)]
    args = [tvm.runtime.tensor(a) for a in args]
    lib["main"](*args)
    scores = np.where(keep, q @ kt * 0.5, -np.inf)
    np.testing.assert_allclose(args[-1].numpy(), _softmax(scores) @ v, rtol=1e-4, atol=1e-5)


def test_kernel_refuses_v_rows_apart():
    with pytest.raises(ValueError, match="V's last axis"):
        attention_kernel(8, 8, 0.5, None, layouts=((0, 1, 2, 3),) * 2 + ((0, 1, 3, 2),))
