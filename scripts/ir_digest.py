"""Digests of the lowered IR that the ``tvm_fusion`` pipeline makes of every embedded workload
(static and dynamic) and of the first ONNX models of ``tests/corpus``, for several targets: run
it in two checkouts and compare the JSON files to show that a refactor changed no generated
code. Each digest is of the module's TVMScript with its lines sorted, since apache-tvm 0.27
orders a shape function's statements differently from run to run.

    PYTHONHASHSEED=0 PYTHONPATH=OLD python scripts/ir_digest.py --out old.json
    PYTHONHASHSEED=0 PYTHONPATH=NEW python scripts/ir_digest.py --out new.json
    python scripts/ir_digest.py --compare old.json new.json
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os

TARGETS = {
    "znver3": {"kind": "llvm", "mcpu": "znver3", "num-cores": 2},
    "znver4": {"kind": "llvm", "mcpu": "znver4", "num-cores": 2},
    "neoverse-v1": {
        "kind": "llvm",
        "mtriple": "aarch64-linux-gnu",
        "mcpu": "neoverse-v1",
        "num-cores": 2,
    },
    "cuda": "cuda",
}


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file of digests to write")
    parser.add_argument("--corpus", type=int, default=12, help="ONNX models of tests/corpus")
    parser.add_argument("--no-workloads", action="store_true", help="corpus models only")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files")
    return parser.parse_args()


def _cases(corpus: int, workloads: bool):
    import tvm_fusion
    from tvm_fusion import models

    for name in models.names() if workloads else []:
        for dynamic in (False, True):
            yield (
                f"{name}/dynamic={dynamic}",
                lambda n=name, d=dynamic: models.build(n, "small", dynamic=d).mod,
            )
    for path in sorted(glob.glob("tests/corpus/*.onnx"))[:corpus]:
        yield os.path.basename(path), lambda p=path: tvm_fusion.load_onnx(p)


def digests(corpus: int, workloads: bool) -> dict[str, str]:
    import tvm_fusion

    targets = {name: tvm_fusion.parse_target(spec) for name, spec in TARGETS.items()}
    out = {}
    for key, build in _cases(corpus, workloads):
        mod = build()
        for name, target in targets.items():
            with target:
                text = tvm_fusion.build_pipeline(target)(mod).script(show_meta=False)
            lines = "\n".join(sorted(text.splitlines()))
            out[f"{key}@{name}"] = hashlib.sha256(lines.encode()).hexdigest()[:16]
            print(key, name, out[f"{key}@{name}"], flush=True)
    return out


def main() -> int:
    args = _parse_args()
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        print(f"{len(set(a) | set(b))} cases, {len(differ)} differ")
        for key in differ:
            print(f"  {key}: {a.get(key)} vs {b.get(key)}")
        return 1 if differ else 0
    result = digests(args.corpus, not args.no_workloads)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
