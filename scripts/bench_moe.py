"""A Mixtral-style MoE layer (issue #38's figures): tvm_fusion on the torch.export and the dynamo
ONNX export vs ONNX Runtime on the same ONNX file and torch eager (the ``batched_mm`` layer and
the same layer with transformers' default grouped experts); decode's share of the machine's
stream bandwidth.

The layer is ``tvm_fusion.testing.moe.batched_mm_moe`` (router, softmax, top-k, renormalise,
``gate_up_proj[ids]`` bmm, ``chunk(2)``, ``silu(g) * u``, ``down_proj[ids]`` bmm, the routing
weight, the top-k sum; float32, random weights), exported once with the token count symbolic
both ways: ``torch.export`` -> ``import_exported_program`` and ``torch.onnx.export(...,
dynamo=True)`` -> ``tvm_fusion.load_onnx``; each compiled once for the host, run at every token
count. Engines alternate (``engine.time_interleaved``), medians, the load average beside
(before the run, and the 1-minute figure after). Every engine's output is compared with torch
eager's (max |diff| / max |torch|).

Stream bandwidth: ``torch.sum`` over a float32 buffer of ``--stream-mb`` (far larger than the
L3) with the same threads, alternated with the engines in the 1-token round; decode's
bandwidth is the selected experts' weight bytes (``top x (2I x H + H x I) x 4``) over our
decode time, reported as a fraction of it: at one fixed token (the experts it reads may be
partly in the L3 from its previous run), and cycling through single tokens routed to pairwise
disjoint experts (``ours (decode, cycled)``: no run reads the experts of the run before).

ONNX Runtime (on the dynamo export, which gathers by GatherND) and torch's ``batched_mm``
materialise the gathered weights, ``tokens x top x (2I x H + H x I) x 4`` bytes (4.4 GB at 64
tokens, 35 GB at 512 at the default sizes): they are skipped where that exceeds
``--max-gather-gb``, said in the row.

    TVM_NUM_THREADS=2 PYTHONPATH=. python scripts/bench_moe.py --tokens 1,64,512 \\
        --json bench/moe.json

Measured on the shared 2-core Zen 3 (AVX2), load average 3.5-4.7, defaults (one run; two
earlier runs in brackets where they differ by more than the noise): ours (torch.export) /
ONNX Runtime 0.28 [0.18, 0.23] at 1 token, 0.105 [0.08] at 64; ours / torch eager with the
grouped experts 0.81 [0.74, 0.74] at 1, 0.22 [0.27, 0.29] at 64, 0.90 [0.86] at 512 (ours on
the ONNX export 0.83 [0.83] there); decode 0.79 [0.88] of the stream bandwidth at a fixed token,
0.85 [0.89] cycled (7.5-8.6 GB/s against 9.5-9.7 GB/s). ORT at 512 tokens would need 35 GB.
Since the rows are sorted by expert (FuseGatheredGates), at 512 tokens: ours / torch grouped
0.59 (torch.export), 0.64 (ONNX export), load 4.1-5.2 (``--tokens 512 --budget 3``, one run).
One expert per register tile (``--ab-sorted``: the same path with the rows sorted only,
alternating; ``--tokens 1,64,512 --budget 3``, load 3.1-4.8): ours / torch grouped 0.42 at
512 tokens (sorted only 0.57; tiles / sorted 0.735), 64 tokens 1.09, 1 token 1.29 (the two
same-kernel paths, torch.export and ONNX, differed by 9% there; the same A/B with 3 engines,
either compile order, gave 0.78-0.86 at 64 tokens and 0.80-0.94 at 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def selected_bytes(hidden: int, inner: int, top: int, itemsize: int = 4) -> int:
    """Bytes of the expert weights one token reads: ``top`` experts' gate-up ``(2I, H)`` and
    down ``(H, I)`` matrices."""
    return top * (2 * inner * hidden + hidden * inner) * itemsize


def stream_runner(megabytes: int, threads: int):
    """``(run, bytes)``: one ``torch.sum`` over a float32 buffer of ``megabytes``."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(megabytes * 2**20 // 4)

    def run():
        return float(data.sum())

    return run, data.numel() * 4


def _disjoint_tokens(model, hidden: int, tries: int = 4096) -> list:
    """Single tokens whose routed experts are pairwise disjoint (greedily, from ``tries``
    random ones): run in turn, each reads experts the previous ones did not, and the cycle's
    weights (all experts' when they pair up) far exceed the L3, so no run finds its experts
    cached by the one before."""
    import torch

    with torch.inference_mode():
        xs = torch.randn(tries, hidden)
        _, ids = model.route(xs)
    chosen, used = [], set()
    for x, experts in zip(xs, ids.tolist(), strict=True):
        if not used & set(experts):
            chosen.append(x[None].numpy())
            used |= set(experts)
    return chosen


def _cycled(compiled, tokens: list):
    """A runner of ``compiled`` on each of ``tokens`` in turn, one per call."""
    import tvm

    from tvm_fusion.build import engine

    runner = engine.TvmRunner(compiled, tokens[:1])
    args = [[tvm.runtime.tensor(t, runner.device)] for t in tokens]
    state = {"next": 0}

    def run():
        runner.args = args[state["next"] % len(args)]
        state["next"] += 1
        return runner()

    return run


def _first(run):
    """The output of a TvmRunner, an onnxruntime runner (a list: its first) or a torch
    function (one tensor), as an array."""
    import numpy as np

    out = run.outputs() if hasattr(run, "outputs") else run()
    return np.asarray(out[0] if isinstance(out, list | tuple) else out)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--tokens", default="1,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=5.0, help="timed seconds per engine")
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--stream-mb", type=int, default=512)
    parser.add_argument(
        "--max-gather-gb",
        type=float,
        default=6.0,
        help="skip onnxruntime and torch's batched_mm where their gathered weight copies "
        "(tokens x the selected bytes) exceed this",
    )
    parser.add_argument(
        "--ab-sorted",
        action="store_true",
        help="also run the torch.export path compiled with the rows sorted by expert only "
        "(FuseGatheredGates without one expert per register tile), alternating",
    )
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _compiled(model, hidden: int, ab_sorted: bool = False):
    """``{path: compiled}`` for both exports (and ``sorted``, the torch.export one without
    expert tiles, with ``ab_sorted``), their rewrites, the ONNX model."""
    import torch

    from tvm_fusion import load_onnx
    from tvm_fusion.build import engine
    from tvm_fusion.frontend.load import import_exported_program
    from tvm_fusion.target import host_target
    from tvm_fusion.transform import collect_rewrites

    example = (torch.randn(7, hidden),)
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    program = torch.export.export(model, example, dynamic_shapes=({0: tokens},))
    onnx_model = torch.onnx.export(
        model, example, dynamo=True, dynamic_shapes=({0: tokens},), verbose=False
    ).model_proto
    mods = {"torch.export": import_exported_program(program), "onnx": load_onnx(onnx_model)}
    compiled, rewrites = {}, {}
    for name, mod in mods.items():
        with collect_rewrites() as counts:
            compiled[name] = engine.compile_module(mod, host_target(), "tvm_fusion")
        rewrites[name] = {k: v for k, v in counts.items() if v}
    if ab_sorted:
        from tvm_fusion.transform import fuse_gathered_gates

        fuse_gathered_gates.ENABLE_EXPERT_TILES = False
        try:
            mod = import_exported_program(program)
            compiled["sorted"] = engine.compile_module(mod, host_target(), "tvm_fusion")
        finally:
            fuse_gathered_gates.ENABLE_EXPERT_TILES = True
    return compiled, rewrites, onnx_model


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        import onnxscript  # noqa: F401 - the dynamo exporter's
        import torch
    except ImportError as err:
        print(f"bench_moe: error: needs torch and onnxscript ({err})", file=sys.stderr)
        return 2
    import numpy as np

    from tvm_fusion.build import engine
    from tvm_fusion.testing.moe import batched_mm_moe, routed_grouped
    from tvm_fusion.tools.analysis.schedules import schedule_info

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = batched_mm_moe(args.hidden, args.inner, args.experts, args.top)
    grouped = routed_grouped(model)
    compiled, rewrites, onnx_model = _compiled(model, args.hidden, args.ab_sorted)
    print("rewrites:", json.dumps(rewrites))
    rules = {i.name: i.rule for i in schedule_info(compiled["torch.export"].lowered)}
    print("kernels (torch.export):", json.dumps(rules))
    stream, stream_bytes = stream_runner(args.stream_mb, args.threads)
    decode_bytes = selected_bytes(args.hidden, args.inner, args.top)
    input_name = onnx_model.graph.input[0].name
    rows = []
    for count in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(count, args.hidden)
        feeds = [x.numpy()]
        runs = {
            "ours (torch.export)": engine.TvmRunner(compiled["torch.export"], feeds),
            "ours (onnx)": engine.TvmRunner(compiled["onnx"], feeds),
        }
        if "sorted" in compiled:
            runs["ours (sorted rows only)"] = engine.TvmRunner(compiled["sorted"], feeds)
        gathers = count * decode_bytes <= args.max_gather_gb * 1e9
        if gathers:  # both materialise W[ids] (tokens x top experts' weights)
            runs["onnxruntime"] = engine.onnxruntime_runner(
                onnx_model, {input_name: feeds[0]}, args.threads
            )

        def eager(module, x=x):
            with torch.inference_mode():
                return module(x)

        runs["torch (grouped)"] = lambda: eager(grouped)
        if gathers:
            runs["torch (batched_mm)"] = lambda: eager(model)
        want = eager(model if gathers else grouped).numpy()  # batched_mm: the exported module
        scale = max(float(np.abs(want).max()), 1e-30)
        errors = {
            name: float(np.abs(_first(run) - want).max() / scale)
            for name, run in runs.items()
            if name != ("torch (batched_mm)" if gathers else "torch (grouped)")
        }
        if count == 1:
            runs["stream"] = stream
            runs["ours (decode, cycled)"] = _cycled(
                compiled["torch.export"], _disjoint_tokens(model, args.hidden)
            )
        load_before = os.getloadavg()
        times = engine.time_interleaved(
            runs, repeat=20, budget_s=args.budget, min_time_s=args.min_time
        )
        ms = {name: t["median_ms"] for name, t in times.items()}
        row = {
            "tokens": count,
            "ms": ms,
            "rel_err_vs_torch": errors,
            "load": [round(v, 2) for v in (*load_before, os.getloadavg()[0])],
        }
        if not gathers:
            row["skipped"] = (
                f"onnxruntime, torch (batched_mm): their W[ids] copies would take "
                f"{count * decode_bytes / 1e9:.1f} GB (--max-gather-gb {args.max_gather_gb})"
            )
        for ours in ("ours (torch.export)", "ours (onnx)", "ours (sorted rows only)"):
            if ours not in ms:
                continue
            if ours == "ours (sorted rows only)":  # the A/B of the expert tiles
                row[f"ours (torch.export) / {ours}"] = ms["ours (torch.export)"] / ms[ours]
            for other in ("onnxruntime", "torch (batched_mm)", "torch (grouped)"):
                if other in ms:
                    row[f"{ours} / {other}"] = ms[ours] / ms[other]
        if count == 1:
            stream_gbs = stream_bytes / ms["stream"] / 1e6
            row["stream_GB/s"] = stream_gbs
            for name in ("ours (torch.export)", "ours (decode, cycled)"):
                row[f"{name} GB/s"] = decode_bytes / ms[name] / 1e6
                row[f"{name} / stream"] = row[f"{name} GB/s"] / stream_gbs
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rewrites": rewrites, "rules": rules, "rows": rows, "args": vars(args)}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
