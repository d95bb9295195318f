"""Stage 6, tools: what a user runs on top of the build.

``cli`` (the ``tvm-fusion`` command), ``bench`` / ``model_bench`` / ``sweep`` (benchmarks against
ONNX Runtime and stock TVM), ``analysis`` (kernel counts, fused groups, the rule that scheduled
each kernel, shape work, peak memory; public as ``tvm_fusion.analysis``). Receives models,
workloads and target strings from the user; parses a target once and hands it down as a
``tvm.target.Target``.
"""
