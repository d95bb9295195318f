"""Test machinery shipped with the package (as ``tvm.testing`` is): not imported by the stages.

``fuzz`` (a subpackage: random ONNX graphs of the patterns the passes rewrite, against ONNX
Runtime, in worker processes; and, in ``fuzz.torch_frontend``, random ``torch.nn`` modules
through ``torch.export``, against torch eager), driven by ``scripts/fuzz.py`` and
``tests/test_fuzz.py``.
"""
