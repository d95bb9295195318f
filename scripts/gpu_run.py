"""Run a GPU bundle made by ``scripts/gpu_bundle.py`` on a CUDA machine that has no apache-tvm.

    python3 gpu_bundle/run_gpu.py --out results [--repeat 50]

Needs only Python, NumPy and the NVIDIA driver plus ``libcudart.so.13`` (the CUDA toolkit's, or
the one in the ``nvidia-cuda-runtime`` wheel that PyTorch brings); torch, when present, is the
peer column. For every case: the ``check`` (small) cases run both pipelines and compare with the
NumPy reference saved here (or, for the backward graphs, stock with ours); the seed cases are
timed, stock vs tvm_fusion vs torch, as medians of ``--repeat`` runs each synchronised with the
device. Writes ``gpu.json`` and ``gpu.md`` to ``--out``.

``--profile PREFIXES``: for the seed cases of those prefixes, also each pipeline's kernels one by
one (``torch.profiler``'s CUDA activity, which sees TVM's launches too: the time of each kernel
on the device per call, averaged over ``PROFILE_CALLS`` calls), into ``profile.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROFILE_CALLS = 20


def _preload_cudart() -> str:
    """libtvm_runtime_cuda.so needs libcudart.so.13: load it by path first (RTLD_GLOBAL), so that
    the dynamic loader finds it whatever LD_LIBRARY_PATH says."""
    patterns = [
        "/usr/local/cuda*/lib64/libcudart.so.13*",
        "/usr/local/cuda*/targets/x86_64-linux/lib/libcudart.so.13*",
        "/usr/lib/x86_64-linux-gnu/libcudart.so.13*",
    ]
    for entry in sys.path:
        patterns.append(os.path.join(entry, "nvidia", "*", "lib", "libcudart.so.13*"))
        patterns.append(os.path.join(entry, "nvidia", "cuda_runtime", "lib", "libcudart.so.13*"))
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
    raise SystemExit("libcudart.so.13 not found (install the CUDA 13 runtime)")


def _import_tvm():
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    sys.path.insert(0, str(HERE / "site"))
    cudart = _preload_cudart()
    import tvm

    lib = HERE / "site" / "tvm" / "lib" / "libtvm_runtime_cuda.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # a clear error if it cannot load
    if not tvm.cuda(0).exist:
        raise SystemExit("TVM's CUDA runtime sees no GPU")
    return tvm, cudart


def _inputs(spec: list[dict], rng) -> list[np.ndarray]:
    arrays = []
    for item in spec:
        if "values" in item:
            arrays.append(np.asarray(item["values"], dtype=item["dtype"]).reshape(item["shape"]))
        else:
            scale = item.get("std", 1.0) or 1.0
            arr = rng.standard_normal(item["shape"], dtype="float32") * scale
            arrays.append(arr.astype(item["dtype"]))
    return arrays


def _flatten(tvm, out) -> list[np.ndarray]:
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    flat = []
    for item in out:
        flat.extend(_flatten(tvm, item))
    return flat


def _median_ms(run, sync, repeat: int, warmup: int = 3, budget_s: float = 5.0) -> float:
    """Median over ``repeat`` samples of the time per call; a sample is ``number`` calls issued
    back to back and one synchronisation (``number`` makes a sample last >= 2 ms, at most 200
    calls), so launch gaps between calls count but one sync per call does not."""
    for _ in range(warmup):
        run()
    sync()
    start = time.perf_counter()
    run()
    sync()
    once = time.perf_counter() - start
    number = max(1, min(200, int(2e-3 / max(once, 1e-6))))
    times = []
    spent = 0.0
    while len(times) < repeat and (len(times) < 5 or spent < budget_s):
        start = time.perf_counter()
        for _ in range(number):
            run()
        sync()
        elapsed = time.perf_counter() - start
        times.append(elapsed / number)
        spent += elapsed
    return float(np.median(times) * 1e3)


def _torch_peer(peer: dict, arrays: list[np.ndarray], repeat: int):
    """The same computation in PyTorch on the GPU (random weights of the same shapes)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    args = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in arrays]

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dev)

    name = peer["workload"]
    fn = None
    if name == "gate_2890":
        (x,) = args
        weight, bias = w(3 * x.shape[1], x.shape[1]), w(3 * x.shape[1])

        def fn():
            s, t, e = F.linear(x, weight, bias).chunk(3, dim=1)
            return torch.sigmoid(s) + torch.tanh(t) * torch.exp(e)
    elif name == "lstm_cell":
        x, c = args
        d = c.shape[1]
        weight, bias = w(4 * d, x.shape[1]), w(4 * d)

        def fn():
            i, f, g, o = F.linear(x, weight, bias).chunk(4, dim=1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c_new), c_new
    elif name == "gru_cell":
        x, h = args
        cell = torch.nn.GRUCell(x.shape[1], h.shape[1]).to(dev)

        def fn():
            return cell(x, h)
    elif name in ("swiglu", "geglu"):
        (x,) = args
        inter = peer["inter"]
        w_gu, w_down = w(2 * inter, x.shape[1]), w(x.shape[1], inter)
        act = F.silu if name == "swiglu" else F.gelu

        def fn():
            gate, up = F.linear(x, w_gu).chunk(2, dim=1)
            return F.linear(act(gate) * up, w_down)
    elif name == "kernel" and peer["kind"] in ("attention", "causal"):  # FuseAttention's
        q, k, v = args
        causal = peer["kind"] == "causal"
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    elif name == "kernel":  # one fused kernel of bench/gpu.md's kernel table
        x = args[0]
        dt, kind, k, d = getattr(torch, peer["dtype"]), peer["kind"], peer["k"], peer["d"]
        gates = {"silu": 2, "2890": 3, "gru": 3, "linear": 1}[kind]
        weight = w(gates * d, k).to(dt)
        bias = w(gates * d).to(dt) if kind in ("2890", "gru") else None
        if kind == "linear":
            fn = lambda: F.linear(x, weight)  # noqa: E731
        elif kind == "silu":

            def fn():
                gate, up = F.linear(x, weight).chunk(2, dim=1)
                return F.silu(gate) * up
        elif kind == "2890":

            def fn():
                s, t, e = F.linear(x, weight, bias).chunk(3, dim=1)
                return torch.sigmoid(s) + torch.tanh(t) * torch.exp(e)
        else:
            cell = torch.nn.GRUCell(k, d).to(dev).to(dt)
            h = args[1]
            fn = lambda: cell(x, h)  # noqa: E731
    elif name == "moe":  # the MoE layer: the faster of its batched_mm form and a per-expert loop
        (x,) = args
        hidden, inner, experts, top = (peer[k] for k in ("hidden", "inner", "experts", "top"))
        router, gate_up, down = (
            w(experts, hidden),
            w(experts, 2 * inner, hidden),
            w(experts, hidden, inner),
        )

        def route():
            p, ids = torch.topk(torch.softmax(x @ router.T, -1), top, dim=-1)
            return p / p.sum(-1, keepdim=True), ids

        def batched():
            p, ids = route()
            t, flat = x.shape[0], ids.reshape(-1)
            xs = x.unsqueeze(1).expand(t, top, hidden).reshape(-1, hidden)
            g, u = torch.bmm(gate_up[flat], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
            h = torch.bmm(down[flat], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
            return (h * p.reshape(-1, 1)).view(t, top, hidden).sum(1)

        def looped():
            p, ids = route()
            out = torch.zeros_like(x)
            for e in ids.unique().tolist():  # one host sync, as transformers' loop has
                rows, slot = torch.nonzero(ids == e, as_tuple=True)
                g, u = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g) * u, down[e]) * p[rows, slot, None]
                out.index_add_(0, rows, y)
            return out

        with torch.inference_mode():
            times = [_median_ms(f, torch.cuda.synchronize, repeat) for f in (batched, looped)]
        return min(times)
    elif name == "cross_entropy":
        x, t = args
        fn = lambda: F.cross_entropy(x, t)  # noqa: E731
    elif name == "ce_fwd_bwd":
        x, t = args

        def fn():
            xg = x.detach().requires_grad_(True)
            F.cross_entropy(xg, t).backward()
            return xg.grad
    elif name in ("take_arange", "take_fwd_bwd"):
        bd, ac = args
        idx = torch.arange(ac.shape[-1], device=dev)
        if name == "take_arange":
            fn = lambda: (ac + torch.index_select(bd, 3, idx)) * 0.125  # noqa: E731
        else:

            def fn():
                xg = bd.detach().requires_grad_(True)
                (((ac + torch.index_select(xg, 3, idx)) * 0.125) ** 2).sum().backward()
                return xg.grad

    if fn is None:
        return None
    grad = name.endswith("fwd_bwd")

    def run():
        if grad:
            return fn()
        with torch.inference_mode():
            return fn()

    return _median_ms(run, torch.cuda.synchronize, repeat)


def _kernel_times(run, sync, calls: int = PROFILE_CALLS) -> dict:
    """Device time per call of each kernel ``run`` launches (microseconds), from the CUDA
    activity ``torch.profiler`` records (CUPTI sees every launch of the process, TVM's too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    for _ in range(3):
        run()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        sync()
    times = {}
    for avg in prof.key_averages():
        total = getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0)
        if total:
            times[avg.key] = {"us": total / calls, "launches": avg.count / calls}
    return times


def _run_pipeline(entry: dict, pipeline: str, repeat: int, kernels: bool = False) -> dict:
    """One case on one pipeline (in a child process: a crash costs only this cell)."""
    tvm, _ = _import_tvm()
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0)
    info = entry["pipelines"][pipeline]
    vm = VirtualMachine(tvm.runtime.load_module(str(HERE / info["file"])), dev)
    func = vm[entry["function"]]
    rng = np.random.default_rng(0)
    if entry["check"]:
        data = np.load(HERE / entry["data"])
        arrays = [data[f"in{i}"] for i in range(len(entry["inputs"]))]
    else:
        arrays = _inputs(entry["inputs"], rng)
        arrays += _inputs([dict(s, std=0.02) for s in info["lifted"]], rng)
    host = set(info.get("host_inputs", []))  # declared host tensors (PlaceShapeOnHost)
    dev_args = [
        tvm.runtime.tensor(a, tvm.cpu() if i in host else dev) for i, a in enumerate(arrays)
    ]
    got = _flatten(tvm, func(*dev_args))
    dev.sync()
    if not entry["check"] and kernels:
        return {"kernels": _kernel_times(lambda: func(*dev_args), dev.sync)}
    if not entry["check"]:
        return {"ms": _median_ms(lambda: func(*dev_args), dev.sync, repeat)}
    data = np.load(HERE / entry["data"])
    against = [data[f"ref{i}"] for i in range(len(data.files) - len(entry["inputs"]))]
    if len(got) != len(against) or any(
        np.shape(g) != np.shape(r) for g, r in zip(got, against, strict=False)
    ):
        return {"err": float("inf"), "ok": False}
    err = max(
        float(np.nanmax(np.abs(np.asarray(g, "float64") - np.asarray(r, "float64"))))
        if np.asarray(g).size
        else 0.0
        for g, r in zip(got, against, strict=True)
    )
    scale = max(float(np.abs(np.asarray(r, "float64")).max()) for r in against)
    result = {"err": err, "ok": bool(err <= entry.get("tol", 1e-3) * max(1.0, scale))}
    if not result["ok"]:  # where it goes wrong, for the log
        first = np.asarray(got[0], "float64")
        bad = ~np.isclose(first, np.asarray(against[0], "float64"), rtol=1e-3, atol=1e-3)
        result["bad_fraction"] = float(bad.mean())
        result["nan_fraction"] = float(np.isnan(first).mean())
        result["first_bad"] = [int(i) for i in np.argwhere(bad)[0]] if bad.any() else []
    return result


def _child(entry: dict, engine: str, repeat: int, kernels: bool = False) -> dict:
    import subprocess

    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        entry["case"],
        engine,
        "--repeat",
        str(repeat),
    ] + (["--kernels-child"] if kernels else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"crash": f"exit {proc.returncode}: {tail[:200]}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_results")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated case prefixes")
    parser.add_argument(
        "--profile", default="", help="comma-separated case prefixes: kernel by kernel too"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--kernels-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    manifest = json.loads((HERE / "manifest.json").read_text())
    cases = {entry["case"]: entry for entry in manifest["cases"]}
    if args.child:
        entry = cases[args.child[0]]
        if args.child[1] == "torch":
            rng = np.random.default_rng(0)
            result = {"ms": _torch_peer(entry["peer"], _inputs(entry["inputs"], rng), args.repeat)}
        else:
            result = _run_pipeline(entry, args.child[1], args.repeat, args.kernels_child)
        print(json.dumps(result), flush=True)
        return 0
    _, cudart = _import_tvm()  # fail early, and clearly, when the runtime cannot load
    only = [p for p in args.only.split(",") if p]
    profiled = [p for p in args.profile.split(",") if p]
    rows, failures, profiles = [], 0, []
    for entry in manifest["cases"]:
        case = entry["case"]
        if only and not any(case.startswith(p) for p in only):
            continue
        row = {"case": case, "check": entry["check"], "errors": dict(entry.get("errors", {}))}
        for pipeline, info in entry["pipelines"].items():
            row[f"{pipeline}_kernels"] = info["kernels"]
            result = _child(entry, pipeline, args.repeat)
            if "crash" in result:
                row["errors"][pipeline] = "crashed on the GPU: " + result["crash"]
                failures += pipeline == "tvm_fusion"
            elif entry["check"]:
                row[f"{pipeline}_err"], row[f"{pipeline}_ok"] = result["err"], result["ok"]
                for key in ("bad_fraction", "nan_fraction", "first_bad"):
                    if key in result:
                        row[f"{pipeline}_{key}"] = result[key]
                failures += not result["ok"]
            else:
                row[pipeline] = result["ms"]
        if not entry["check"]:
            row["torch"] = _child(entry, "torch", args.repeat).get("ms")
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not entry["check"] and any(case.startswith(p) for p in profiled):
            for pipeline in entry["pipelines"]:
                got = _child(entry, pipeline, args.repeat, kernels=True)
                profiles.append({"case": case, "pipeline": pipeline, **got})
                print(json.dumps(profiles[-1]), flush=True)
                for name, t in sorted(got.get("kernels", {}).items(), key=lambda kv: -kv[1]["us"]):
                    print(f"  {case} {pipeline}: {t['us']:9.1f} us x{t['launches']:g} {name[:70]}")
    device = _device_name()
    result = {
        "device": device,
        "arch": manifest["arch"],
        "tvm": manifest["tvm"],
        "cudart": cudart,
        "repeat": args.repeat,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    if profiles:
        (out / "profile.json").write_text(json.dumps(profiles, indent=1))
    (out / "gpu.md").write_text(_markdown(result))
    print(_markdown(result))
    return 1 if failures else 0


def _device_name() -> str:
    try:
        import subprocess

        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.4g}"


def _markdown(result: dict) -> str:
    lines = [
        f"GPU: {result['device']}, {result['arch']}, apache-tvm {result['tvm']} runtime.",
        "",
        "Compiled on the CPU machine (`python scripts/gpu_bundle.py --out gpu_bundle`: device "
        "code by nvcc, stock TVM's CUDA pipeline with its dlight defaults vs tvm_fusion's), run "
        f"here with `python3 gpu_bundle/run_gpu.py` (no apache-tvm installed: TVM's runtime "
        f"from the bundle). Times: median of {result.get('repeat', '?')} samples, each a batch "
        "of back-to-back calls (>= 2 ms, at most 200 calls) and one synchronisation, per call; "
        "seed sizes, weights random (lifted out of the module to keep the bundle small); torch: "
        "the same computation in PyTorch on this GPU, in the case's dtype (float32 matmuls "
        "without TF32, torch's default). The "
        "check table runs the small sizes against NumPy (backward graphs: stock TVM on the "
        "CPU).",
        "",
    ]
    lines += [
        "| case | kernels stock/ours | stock ms | tvm-fusion ms | torch ms | ours/stock |"
        " ours/torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["check"]:
            continue
        stock, ours, torch = row.get("stock"), row.get("tvm_fusion"), row.get("torch")
        lines.append(
            f"| {row['case']} | {row.get('stock_kernels', '-')}/"
            f"{row.get('tvm_fusion_kernels', '-')} | "
            f"{_fmt(stock)} | {_fmt(ours)} | {_fmt(torch)} | "
            f"{_fmt(ours / stock) + 'x' if stock and ours else ''} | "
            f"{_fmt(ours / torch) + 'x' if torch and ours else ''} |"
        )
    variants = sorted(
        {k for row in result["rows"] for k in row if k.startswith("tvm_fusion_without_")}
        - {k for row in result["rows"] for k in row if k.endswith(("_kernels", "_err", "_ok"))}
    )
    for variant in variants:
        lines += [
            "",
            f"| case | {variant} ms | tvm-fusion ms | ours/{variant} |",
            "|---|---|---|---|",
        ]
        for row in result["rows"]:
            if not row["check"] and row.get(variant):
                ours = row.get("tvm_fusion")
                lines.append(
                    f"| {row['case']} | {_fmt(row[variant])} | {_fmt(ours)} | "
                    f"{_fmt(ours / row[variant]) + 'x' if ours else ''} |"
                )
    lines += [
        "",
        "| check (small sizes) | stock max err | ours max err | ours ok |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["check"]:
            cells = []
            for pipeline in ("stock", "tvm_fusion"):
                if pipeline in row["errors"]:
                    cells.append(row["errors"][pipeline][:60])
                else:
                    cells.append(f"{row.get(pipeline + '_err', float('nan')):.2e}")
            ok = row.get("tvm_fusion_ok", False)
            lines.append(f"| {row['case']} | {cells[0]} | {cells[1]} | {'yes' if ok else 'NO'} |")
    failed = [
        f"{row['case']} {p}: {e}"
        for row in result["rows"]
        if not row["check"]
        for p, e in row["errors"].items()
    ]
    if failed:
        lines += ["", "Failures (compile here or run there):", *[f"- {f}" for f in failed]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
