"""Stage 3, lower: from Relax ops to TIR, the parts stock TVM lacks.

Receives Relax ops (from the graph passes) and hands on TIR: ``legalize`` (the LegalizeOps map
the pipeline's Phase 2 uses: polynomial exp / erf / tanh on CPU, row reductions as whole-vector
partials, half-precision GEMMs accumulated in float32), ``gradients`` (the ``FPrimalGradient``
registrations apache-tvm 0.27 lacks) and hand-written TIR kernels (``rnn_loop``: the recurrent
loop kernel the ONNX importer emits for a dynamic sequence). Imports the ground modules only;
the graph passes above use its fast-math TE (FuseSplitGates' gate math, FuseCrossEntropy's rows).
"""
