"""transformers' grouped mixture-of-experts layer without transformers (issue #38).

:func:`define_grouped_mm` registers ``<namespace>::grouped_mm_fallback`` as transformers 5.x does
in ``transformers/integrations/moe.py`` (schema and eager body copied), so that programs calling
it can be exported, saved and run eagerly; :func:`grouped_experts` is transformers'
``grouped_mm_experts_forward`` (sort the ``(token, expert)`` pairs, ``histc`` counts, ``cumsum``
offsets, a grouped GEMM, ``chunk(2)``, ``silu(g) * u``, the down grouped GEMM, the routing
weight, the top-k sum). Used by ``tests/test_moe_grouped.py`` and ``scripts/bench_moe_grouped.py``;
torch is imported on first use.
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
