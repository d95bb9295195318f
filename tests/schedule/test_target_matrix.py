"""Compile-only: every embedded workload (static and dynamic) and one exported model per family
of the corpus are scheduled by our rules on each CPU target of the matrix
(tests/schedule/conftest.py: SSE4.2, AVX2, AVX-512, NEON on Linux and on Apple silicon), with no
kernel left to the fallback rule. The pipeline runs up to the final lowered module (no code
generation), so the check is cheap and independent of the host; the numbers of each workload
are checked on the host's own build in tests/test_models.py, those of the corpus in
tests/test_corpus.py."""

import functools
from pathlib import Path

import pytest

from tvm_fusion import analysis, build_pipeline, load_onnx, models

CORPUS_DIR = Path(__file__).resolve().parent.parent / "corpus"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", models.names())
def test_no_fallback_kernel_on_any_target(cpu_target, name, dynamic):
    mod = models.build(name, "small", dynamic=dynamic).mod
    with cpu_target:
        lowered = build_pipeline(cpu_target)(mod)
    assert not analysis.fallback_kernels(lowered), {
        i.name: i.rule for i in analysis.schedule_info(lowered)
    }


# One exported model per family of the corpus: a recurrent sequence, a gate cell, a vision
# transformer (conv patch embedding), an LM head with a loss, a decoder (tests/corpus/).
CORPUS = [
    "gru_dynamo",
    "lstm_cell_torchscript",
    "vit_dynamo",
    "gpt2_labels_torchscript",
    "llama_torchscript",
]


@functools.cache
def _corpus_module(name: str):
    return load_onnx(CORPUS_DIR / f"{name}.onnx")


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_has_no_fallback_kernel_on_any_target(cpu_target, name):
    with cpu_target:
        lowered = build_pipeline(cpu_target)(_corpus_module(name))
    assert not analysis.fallback_kernels(lowered), {
        i.name: i.rule for i in analysis.schedule_info(lowered)
    }
