#!/usr/bin/env python3
"""MetaSchedule tuning run over the fused groups; same as ``tvm-fusion tune``.

python scripts/tune.py gate_2890 --trials 512 --work-dir tune/gate_2890
python scripts/tune.py gate_2890 --trials 512 --work-dir tune/gate_2890_stock --pipeline stock
tvm-fusion bench --workloads gate_2890 --tuning-db tune/gate_2890
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from tvm_fusion.tools.cli import main

    sys.exit(main(["tune", *sys.argv[1:]]))
