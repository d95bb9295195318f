"""Stage 1, frontend: models in, Relax IRModules out.

Receives an ONNX file or ``ModelProto`` (``load_onnx``) or a saved ``torch.export`` program
(``load_exported_program``, or an ``ExportedProgram`` in memory: ``import_exported_program``);
``load_model`` picks by the suffix. Hands on a Relax IRModule whose ``main`` takes the model's
inputs, in the forms the graph passes (``tvm_fusion.transform``) read: the converters stock TVM
lacks or gets wrong (``onnx_ops``, ``torch_ops``), ONNX's recurrent ops (``onnx_rnn``: unrolled,
or one loop kernel of ``tvm_fusion.lower.rnn_loop`` per direction). Errors are one-line
:class:`~tvm_fusion.errors.ModelError`s naming the node.
"""

from .load import (
    import_exported_program,
    load_exported_program,
    load_model,
    load_onnx,
)
from .onnx_fold import fold_constants

__all__ = [
    "fold_constants",
    "import_exported_program",
    "load_exported_program",
    "load_model",
    "load_onnx",
]
