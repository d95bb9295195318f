"""transformers' grouped mixture-of-experts layer without transformers (issue #38).

:func:`define_grouped_mm` registers ``<namespace>::grouped_mm_fallback`` as transformers 5.x does
in ``transformers/integrations/moe.py`` (schema and eager body copied), so that programs calling
it can be exported, saved and run eagerly; :func:`grouped_experts` is transformers'
``grouped_mm_experts_forward`` (sort the ``(token, expert)`` pairs, ``histc`` counts, ``cumsum``
offsets, a grouped GEMM, ``chunk(2)``, ``silu(g) * u``, the down grouped GEMM, the routing
weight, the top-k sum). :func:`batched_mm_moe` is a whole Mixtral-style layer in the
``batched_mm`` form (the export-friendly one), :func:`routed_grouped` the same layer with the
grouped experts. Used by ``tests/test_moe_grouped.py``, ``scripts/bench_moe_grouped.py``,
``scripts/bench_moe.py`` and ``scripts/moe_memory.py``; torch is imported on first use.
"""

from __future__ import annotations

SCHEMA = "(Tensor input, Tensor weight, Tensor offs) -> Tensor"


def define_grouped_mm(namespace: str = "transformers") -> None:
    """Register ``namespace::grouped_mm_fallback`` (with its fake) unless it exists."""
    import torch

    def fallback(input, weight, offs):  # transformers' eager body
        output = torch.zeros(input.size(0), weight.size(2), dtype=input.dtype)
        start = 0
        for i, end in enumerate(offs.tolist()):
            if start == end:
                continue
            torch.mm(input[start:end], weight[i], out=output[start:end])
            start = end
        return output

    def fake(input, weight, offs):
        return torch.empty(input.size(0), weight.size(2), dtype=input.dtype)

    if not hasattr(getattr(torch.ops, namespace), "grouped_mm_fallback"):
        name = f"{namespace}::grouped_mm_fallback"
        torch.library.custom_op(name, fallback, mutates_args=(), schema=SCHEMA)
        torch.library.register_fake(name, fake)


def grouped_experts(experts: int, hidden: int = 8, inter: int = 6, gate: str = "silu"):
    """transformers' ``grouped_mm_experts_forward`` (gated, not transposed) as a module of
    ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``; ``gate`` the
    activation of the gate half (``silu``, ``gelu``, ``gelu_tanh``, ``relu``)."""
    import torch

    define_grouped_mm()
    fn = torch.nn.functional
    act = {
        "silu": fn.silu,
        "gelu": fn.gelu,
        "gelu_tanh": lambda t: fn.gelu(t, approximate="tanh"),
        "relu": fn.relu,
    }[gate]

    class GroupedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = experts
            self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) / 3)
            self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter) / 3)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            num_top_k = top_k_index.size(-1)
            num_tokens = hidden_states.size(0)
            sample_weights = top_k_weights.reshape(-1)
            expert_ids = top_k_index.reshape(-1)
            expert_ids_g, perm = torch.sort(expert_ids)
            selected = hidden_states[perm // num_top_k]
            sample_weights_g = sample_weights[perm]
            counts = torch.histc(
                expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1
            )
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            grouped = torch.ops.transformers.grouped_mm_fallback
            proj = grouped(selected, self.gate_up_proj.transpose(-2, -1), offs=offsets)
            g, u = proj.chunk(2, dim=-1)
            proj = act(g) * u
            proj = grouped(proj, self.down_proj.transpose(-2, -1), offs=offsets)
            weighted = proj * sample_weights_g.unsqueeze(-1)
            inv_perm = torch.empty_like(perm)
            inv_perm[perm] = torch.arange(perm.size(0))
            weighted = weighted[inv_perm]
            return weighted.view(num_tokens, num_top_k, -1).sum(dim=1)

    return GroupedExperts()


def batched_mm_moe(hidden: int, inner: int, experts: int, top: int, scale: float = 0.02):
    """A Mixtral-style sparse MoE block in transformers' ``batched_mm`` form, a module of
    ``x (T, H)``: router ``Linear``, softmax, top-k, the weights renormalised,
    ``gate_up_proj[ids]`` bmm, ``chunk(2)``, ``silu(g) * u``, ``down_proj[ids]`` bmm, times the
    routing weight, ``view(T, k, H).sum(1)``; random weights times ``scale``."""
    import torch

    fn = torch.nn.functional

    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.top = top
            self.router = torch.nn.Linear(hidden, experts, bias=False)
            self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden) * scale)
            self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inner) * scale)

        def route(self, x):
            w, ids = torch.topk(fn.softmax(self.router(x), dim=-1), top, dim=-1)
            return w / w.sum(-1, keepdim=True), ids

        def forward(self, x):
            w, ids = self.route(x)
            t = x.shape[0]
            flat = ids.reshape(-1)
            xs = x.unsqueeze(1).expand(t, top, hidden).reshape(-1, hidden)
            gu = torch.bmm(self.gate_up_proj[flat], xs.unsqueeze(-1)).squeeze(-1)
            g, u = gu.chunk(2, dim=-1)
            h = torch.bmm(self.down_proj[flat], (fn.silu(g) * u).unsqueeze(-1)).squeeze(-1)
            return (h * w.reshape(-1, 1)).view(t, top, hidden).sum(1)

    return MoE().eval()


def routed_grouped(moe):
    """``moe`` (:func:`batched_mm_moe`) with transformers' default experts instead: the same
    router and weights (shared, not copied), the experts of :func:`grouped_experts`."""
    import torch

    experts, inner2, hidden = moe.gate_up_proj.shape
    grouped = grouped_experts(experts, hidden, inner2 // 2)
    grouped.gate_up_proj = moe.gate_up_proj
    grouped.down_proj = moe.down_proj

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.experts = moe, grouped

        def forward(self, x):
            w, ids = self.moe.route(x)
            return self.experts(x, ids, w)

    return Routed().eval()
