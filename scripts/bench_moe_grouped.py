"""transformers' grouped MoE experts (``grouped_mm_fallback``, issue #38): tvm_fusion vs torch
eager on the same module, engines alternating (``engine.time_interleaved``), medians, the load
average beside; which schedule rule took each kernel.

The experts of ``tvm_fusion.testing.moe.grouped_experts`` (H, I, E experts, top-k; random
routing, float32) exported with torch.export (tokens symbolic), imported and compiled for the
host; the same compiled module runs every token count.

    TVM_NUM_THREADS=2 PYTHONPATH=. python scripts/bench_moe_grouped.py --tokens 1,64,512 --unfused

``--unfused`` adds the same pipeline with FuseGroupedGates off (the converter's grouped GEMM
kernels, as before the pass) to the alternation.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--tokens", default="1,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=6.0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="also time the pipeline with FuseGroupedGates off (the converter's kernels)",
    )
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from tvm_fusion.build import engine
    from tvm_fusion.frontend import load
    from tvm_fusion.target import host_target
    from tvm_fusion.testing.moe import grouped_experts
    from tvm_fusion.tools.analysis.schedules import schedule_info

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = grouped_experts(args.experts, args.hidden, args.inner).eval()
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    example = (
        torch.randn(7, args.hidden),
        torch.randint(0, args.experts, (7, args.top)),
        torch.rand(7, args.top),
    )
    program = torch.export.export(model, example, dynamic_shapes=({0: tokens},) * 3)
    mod = load.import_exported_program(program)
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    unfused = None
    if args.unfused:
        unfused = engine.compile_module(mod, host_target(), "tvm_fusion", fuse_grouped_gates=False)
    rules = {i.name: i.rule for i in schedule_info(compiled.lowered)}
    print("kernels:", json.dumps(rules, indent=1))
    rows = []
    for count in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(count, args.hidden)
        ids = torch.stack([torch.randperm(args.experts)[: args.top] for _ in range(count)])
        weights = torch.rand(count, args.top)
        feeds = [x.numpy(), ids.numpy(), weights.numpy()]
        ours = engine.TvmRunner(compiled, feeds)
        runs = {"ours": ours}
        if unfused is not None:
            runs["unfused"] = engine.TvmRunner(unfused, feeds)
        with torch.inference_mode():
            want = model(x, ids, weights).numpy()
        got = np.asarray(ours.outputs()[0])
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

        def eager(x=x, ids=ids, weights=weights):
            with torch.inference_mode():
                return model(x, ids, weights)

        load_before = os.getloadavg()
        times = engine.time_interleaved(
            {**runs, "torch": eager}, repeat=50, budget_s=args.budget, min_time_s=0.5
        )
        row = {
            "tokens": count,
            "ours_ms": times["ours"]["median_ms"],
            "torch_ms": times["torch"]["median_ms"],
            "rel_err": err,
            "load": [round(v, 2) for v in (*load_before, *os.getloadavg()[:1])],
        }
        row["ours/torch"] = row["ours_ms"] / row["torch_ms"]
        if unfused is not None:
            row["unfused_ms"] = times["unfused"]["median_ms"]
            row["unfused/torch"] = row["unfused_ms"] / row["torch_ms"]
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rules": rules, "rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
