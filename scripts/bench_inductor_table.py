#!/usr/bin/env python3
"""Issue #41's table against Inductor: nine torch modules (gated MLPs, LSTM cell and sequence,
cross entropy, LM head + loss, a GPT-style block at three sizes) through ``torch.export``,
tvm_fusion vs ``torch.compile(dynamic=False)`` (Inductor) vs torch eager; engines alternating
round by round with pauses, medians, load beside each row.

Each module is exported at static shapes, imported with
``tvm_fusion.frontend.import_exported_program`` and compiled with the ``tvm_fusion`` pipeline for
``host_target()`` (``--mcpu`` builds for another CPU, e.g. ``znver3`` for AVX2 code on an AVX-512
host). Inductor and eager run the same module. Outputs are compared with eager (max |out - eager|
/ max |eager| over all outputs; over 1e-3 the row says MISMATCH and the script exits 1). Compile
seconds are kept apart from run times: ours = import + pipeline + code generation, Inductor's =
its first call. A module that fails is one line in its row and the run goes on.

    PYTHONPATH=. python scripts/bench_inductor_table.py              # all nine, 2 threads
    PYTHONPATH=. python scripts/bench_inductor_table.py --only lstm_seq,gpt_block_512 \\
        --json /tmp/t.json

Needs torch with a working Inductor (a C++ compiler).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decoders_inductor import bench_module, isa_line  # noqa: E402


def _modules(torch):
    """name -> (description, module maker, inputs maker); seeded, small weights."""
    nn, F = torch.nn, torch.nn.functional

    class GatedMLP(nn.Module):
        def __init__(self, hidden, inner, bias, act):
            super().__init__()
            self.gate_up = nn.Linear(hidden, 2 * inner, bias=bias)
            self.down = nn.Linear(inner, hidden, bias=bias)
            self.act = act

        def forward(self, x):
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down(self.act(g) * u)

    class Cell(nn.Module):
        def __init__(self, size):
            super().__init__()
            self.cell = nn.LSTMCell(size, size)

        def forward(self, x, h, c):
            return self.cell(x, (h, c))

    class Sequence(nn.Module):
        def __init__(self, size):
            super().__init__()
            self.lstm = nn.LSTM(size, size, batch_first=True)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return out, h, c

    class CrossEntropy(nn.Module):
        def forward(self, logits, labels):
            return F.cross_entropy(logits, labels)

    class HeadLoss(nn.Module):
        def __init__(self, hidden, vocab):
            super().__init__()
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, x, labels):
            return F.cross_entropy(self.head(x), labels)

    class Block(nn.Module):
        """Pre-LN GPT block: LayerNorm, fused qkv, causal SDPA, out projection, residual,
        LayerNorm, tanh-GELU MLP (4x), residual."""

        def __init__(self, hidden, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    def randn(*shape):
        return torch.randn(*shape)

    def labels(n, vocab):
        return torch.randint(0, vocab, (n,))

    silu = F.silu

    def gelu_tanh(t):
        return F.gelu(t, approximate="tanh")

    return {
        "swiglu": (
            "SwiGLU MLP 4x61x512 -> 2x1376 -> 512",
            lambda: GatedMLP(512, 1376, False, silu),
            lambda: (randn(4, 61, 512),),
        ),
        "geglu_bias": (
            "gate_up + tanh-GELU MLP with biases 4x61x512 -> 2x1376 -> 512",
            lambda: GatedMLP(512, 1376, True, gelu_tanh),
            lambda: (randn(4, 61, 512),),
        ),
        "lstm_cell": (
            "nn.LSTMCell batch 64, 512",
            lambda: Cell(512),
            lambda: (randn(64, 512), randn(64, 512), randn(64, 512)),
        ),
        "lstm_seq": (
            "nn.LSTM sequence batch 8, seq 48, 256",
            lambda: Sequence(256),
            lambda: (randn(8, 48, 256),),
        ),
        "cross_entropy": (
            "cross entropy 509 x 50257",
            CrossEntropy,
            lambda: (randn(509, 50257), labels(509, 50257)),
        ),
        "lm_head_ce": (
            "LM head + cross entropy 256 x 256 -> 32003",
            lambda: HeadLoss(256, 32003),
            lambda: (randn(256, 256), labels(256, 32003)),
        ),
        "gpt_block_63": (
            "GPT block 8 x 63 x 256, 4 heads",
            lambda: Block(256, 4),
            lambda: (randn(8, 63, 256),),
        ),
        "gpt_block_512": (
            "GPT block 1 x 512 x 256, 4 heads",
            lambda: Block(256, 4),
            lambda: (randn(1, 512, 256),),
        ),
        "gpt_block_4x512": (
            "GPT block 4 x 512 x 512, 8 heads",
            lambda: Block(512, 8),
            lambda: (randn(4, 512, 512),),
        ),
    }


def bench_row(
    name, desc, module, args, *, target, threads, repeat, budget, inductor=None, min_time=2.0
) -> dict:
    """One row: ``bench_decoders_inductor.bench_module`` of ``module(*args)``, at least
    ``min_time`` seconds of timed runs per engine (the cell and CE rows are milliseconds)."""
    return bench_module(
        {"workload": name, "what": desc}, name, module, tuple(args), target=target,
        threads=threads, repeat=repeat, budget=budget, inductor=inductor, min_time=min_time,
    )  # fmt: skip


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def markdown(rows, machine: str, threads: int, command: str) -> str:
    lines = [
        "# Issue #41's table: tvm_fusion vs Inductor vs torch eager (torch.export, static)",
        "",
        f"Machine: {machine}. Threads: {threads} for every engine. Command: `{command}`.",
        "Medians of warm calls, engines alternating round by round with pauses; load: the "
        "1/5/15-minute load averages before the row's timing and the 1-minute one after.",
        "",
        "| workload | ours ms | inductor ms | eager ms | ours/inductor | ours/eager "
        "| compile s ours / inductor | rel err ours / inductor | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['what']} | failed | | | | | | | |")
            notes.append(f"- {r['workload']}: {r['failed']}")
            continue
        if "inductor_failed" in r:
            notes.append(f"- {r['workload']}: {r['inductor_failed']}")
        errs = " / ".join(_num(r.get(f"rel_err_{e}"), ".1e") for e in ("ours", "inductor"))
        if r.get("mismatch"):
            errs += f" **MISMATCH ({', '.join(r['mismatch'])})**"
        comp = " / ".join(_num(r.get(f"compile_s_{e}"), ".1f") for e in ("ours", "inductor"))
        lines.append(
            f"| {r['what']} | {_num(r.get('ours_ms'), '.3f')} | "
            f"{_num(r.get('inductor_ms'), '.3f')} | {_num(r.get('eager_ms'), '.3f')} | "
            f"{_num(r.get('ours/inductor'), '.2f')} | {_num(r.get('ours/eager'), '.2f')} | "
            f"{comp} | {errs} | {' '.join(f'{v:.1f}' for v in r.get('load', []))} |"
        )
    gi = geomean(r.get("ours/inductor") for r in rows)
    ge = geomean(r.get("ours/eager") for r in rows)
    lines += ["", f"Geomean ours/inductor {_num(gi, '.3f')}, ours/eager {_num(ge, '.3f')}."]
    if notes:
        lines += ["", "Failures:", *notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated workload names")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--budget", type=float, default=5.0, help="timed seconds per engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mcpu", default=None, help="build ours for this CPU (LLVM's name)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    prog = "bench_inductor_table"
    if args.threads < 1:
        print(f"{prog}: error: --threads takes a positive integer", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print(f"{prog}: error: needs torch", file=sys.stderr)
        return 2
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's pool starts
    import logging
    import warnings

    from tvm_fusion.target import host_target
    from tvm_fusion.tools.bench import bench_target

    table = _modules(torch)
    names = [n for n in args.only.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(
            f"{prog}: error: unknown workload(s) {unknown}; known: {list(table)}", file=sys.stderr
        )
        return 2
    warnings.simplefilter("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    target = bench_target(host_target(), args.mcpu)
    machine = f"{isa_line()}; ours built for {target.attrs.get('mcpu', 'host')}"
    command = " ".join(["python", "scripts/bench_inductor_table.py", *(argv or sys.argv[1:])])
    print(f"# {machine}; torch {torch.__version__}", flush=True)
    rows = []
    for name in names:
        desc, make, make_inputs = table[name]
        torch.manual_seed(0)
        module = make().eval()
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(0.5)
        row = bench_row(
            name,
            desc,
            module,
            make_inputs(),
            target=target,
            threads=args.threads,
            repeat=args.repeat,
            budget=args.budget,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(markdown(rows, machine, args.threads, command), end="")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "command": command,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if any(r.get("failed") or r.get("mismatch") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
