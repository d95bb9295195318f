#!/usr/bin/env python3
"""Rewrites per graph pass (``fusion_passes``) for every ONNX model of the corpus, as JSON on
stdout: ``{model: {pass: count}}``, or ``"error: ..."`` where the import or a pass fails.

Run it against another checkout to compare (the corpus is read from this one):

    python scripts/corpus_rewrites.py > after.json
    git worktree add /tmp/before REV && PYTHONPATH=/tmp/before python scripts/corpus_rewrites.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus"


def main() -> int:
    warnings.simplefilter("ignore")
    import tvm

    import tvm_fusion
    from tvm_fusion.build.pipeline import fusion_passes
    from tvm_fusion.transform import collect_rewrites

    manifest = json.loads((CORPUS / "manifest.json").read_text())
    out: dict = {}
    for key in sorted(manifest):
        entry = manifest[key]
        if "file" not in entry:
            continue
        try:
            mod = tvm_fusion.load_onnx(CORPUS / entry["file"])
            with collect_rewrites() as counts:
                tvm.transform.Sequential(fusion_passes(tvm_fusion.host_target()))(mod)
            out[key] = {name: n for name, n in counts.items() if n}
        except Exception as err:  # a row of the table, not a crash of the script
            out[key] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
