"""Planned peak memory of one mixture-of-experts layer, tvm_fusion vs stock (issue #38).

A Mixtral-style sparse MoE block in transformers' ``batched_mm`` form (router, softmax, top-k,
``gate_up_proj[ids]`` bmm, ``chunk(2)``, ``silu(g) * u``, ``down_proj[ids]`` bmm, times the
routing weight, ``view(T, k, H).sum(1)``), random weights, exported with torch.export at a fixed
token count, imported with ``tvm_fusion.frontend``, compiled for the host by both pipelines
(not run): ``analysis.peak_bytes`` of each (weights, which are constants, not counted).

    PYTHONPATH=. python scripts/moe_memory.py --hidden 1024 --inner 2816 --experts 8 --top 2 \\
        --tokens 64
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    import tvm_fusion
    from tvm_fusion import analysis
    from tvm_fusion.build import engine
    from tvm_fusion.frontend.load import import_exported_program
    from tvm_fusion.testing.moe import batched_mm_moe
    from tvm_fusion.transform import collect_rewrites

    torch.manual_seed(0)
    model = batched_mm_moe(args.hidden, args.inner, args.experts, args.top)
    program = torch.export.export(model, (torch.randn(args.tokens, args.hidden),))
    mod = import_exported_program(program)
    target = tvm_fusion.host_target()
    peaks = {}
    for pipeline in ("stock", "tvm_fusion"):
        with collect_rewrites() as counts:
            compiled = engine.compile_module(mod, target, pipeline)
        peaks[pipeline] = analysis.peak_bytes(compiled.lowered)
        print(f"{pipeline}: planned peak {peaks[pipeline]} bytes; rewrites {dict(counts)}")
    if None not in peaks.values():
        print(f"ours / stock: {peaks['tvm_fusion'] / peaks['stock']:.4f}")


if __name__ == "__main__":
    main()
