"""Stage 5, build: the stages composed into a pipeline, compiled and run.

Receives a Relax IRModule and a ``tvm.target.Target`` (parsed once, where the user handed it in)
and hands on compiled modules: ``pipeline`` (the phases, ``fusion_passes``, the registered
``"tvm_fusion"`` pipeline and its flags), ``engine`` (compile with stock's or our pipeline, run,
time in alternating rounds), ``tuning`` (MetaSchedule over the fused groups, databases that the
pipeline applies).
"""
