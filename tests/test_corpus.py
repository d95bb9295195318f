"""The real-model corpus (tests/corpus, written by scripts/export_corpus.py from transformers /
torch.nn models with both torch exporters): each model imports with ``load_onnx``, compiles
with the tvm_fusion pipeline, matches ONNX Runtime's saved outputs at other batch/sequence
sizes than the export's, and our passes fire where their pattern is in the model."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run

import tvm_fusion
from tvm_fusion import analysis
from tvm_fusion.frontend import load_onnx
from tvm_fusion.transform import collect_rewrites

CORPUS = Path(__file__).parent / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())
MODELS = sorted(k for k, v in MANIFEST.items() if not k.startswith("_") and "skipped" not in v)

# what must fire in each model (pass -> at least this many rewrites; "kernels": ours at most)
EXPECT = {
    # GatherToSlice: the position embedding of a position_ids buffer, (1, seq) rows
    "bert_mlm": {
        "FuseCrossEntropy": 1,
        "PlaceShapeOnHost": 1,
        "StripBookendViews": 1,
        "GatherToSlice": 1,
    },
    "distilbert": {"PlaceShapeOnHost": 1, "StripBookendViews": 1, "GatherToSlice": 1},
    "gpt2": {
        "PlaceShapeOnHost": 1,
        "StripBookendViews": 1,
        "SinkViewsPastEpilogues": 6,
        "GatherToSlice": 1,
    },
    # the loss only: the LM head's (N, V) logits chunked over symbolic rows (batch * seq)
    "gpt2_labels": {
        "PlaceShapeOnHost": 1,
        "GatherToSlice": 1,
        "FuseCrossEntropy": 1,
        "FuseLinearCrossEntropy": 1,
    },
    "llama": {"PlaceShapeOnHost": 1, "StripBookendViews": 1, "FuseSplitGates": 2},  # MLPs
    "xlnet": {"GatherToSlice": 1, "StripBookendViews": 1},
    "gru_cell": {"FuseSplitGates": 1, "kernels": 1},
    "lstm_cell": {"FuseSplitGates": 1, "kernels": 2},  # concat(x, h), gates
    "lstm_hand": {"FuseSplitGates": 1, "kernels": 2},
    "swiglu_chunk": {"FuseSplitGates": 1, "kernels": 2},
    # nn.LSTM / nn.GRU, 2 layers, dynamic batch and sequence: per layer the input projection
    # (one GEMM) and one loop kernel over time; the rest zero states and stacks the outputs
    "lstm": {"kernels": 13},
    "gru": {"kernels": 10},
}
# issue #27, encoders and an encoder-decoder (branch arch-enc); the least over both exporters
EXPECT.update(
    {
        # position ids gathered from a buffer: GatherToSlice; the causal mask's shapes on the host
        "clip_text": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "GatherToSlice": 1},
        # relative positions: Tile of a shape (repeat), Range / Clip on the host's seq
        "deberta_v2": {"PlaceShapeOnHost": 1, "StripBookendViews": 1, "GatherToSlice": 1},
        # the MLM loss with labels (logits are an output too: no chunking)
        "distilbert_labels": {
            "PlaceShapeOnHost": 2,
            "StripBookendViews": 1,
            "GatherToSlice": 1,
            "FuseCrossEntropy": 1,
        },
        # gated GELU (wi_0 / wi_1) in the encoder's and the decoder's block
        "t5": {"PlaceShapeOnHost": 3, "StripBookendViews": 1, "FuseSplitGates": 2},
        # batch only: no shape chains, no gathers, no gates; the views around the GEMMs
        "vit": {"StripBookendViews": 1},
        "whisper_encoder": {"StripBookendViews": 1},
    }
)
# Decoder-only LMs (issue #27): shape chains on the host (OPT's positions: a cumsum of the
# mask), the SwiGLU MLPs of Qwen2 / Mistral and Phi-3's fused gate_up_proj as one gate kernel
# per layer; GPT-NeoX and Falcon have GELU MLPs (no gates; their fused QKV feeds attention).
EXPECT.update(
    {
        "opt": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "SinkViewsPastEpilogues": 1},
        "qwen2": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "FuseSplitGates": 2},
        "phi3": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "FuseSplitGates": 2},
        "mistral": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "FuseSplitGates": 2},
        "gpt_neox": {"PlaceShapeOnHost": 2, "StripBookendViews": 1},
        "falcon": {"PlaceShapeOnHost": 2, "StripBookendViews": 1},
    }
)
# Mixture-of-experts decoders (issue #38), transformers' batched_mm experts: per layer the
# routed experts' gate-up (SwiGLU) and down projections on gathered expert weights, each one
# FuseGatheredGates kernel, from both exporters (the TorchScript one after fold_constants
# folds its repeat_interleave's OneHot repeats); Qwen2-MoE's shared expert, a dense SwiGLU
# behind a sigmoid gate: FuseSplitGates per layer.
EXPECT.update(
    {
        "mixtral": {"PlaceShapeOnHost": 2, "StripBookendViews": 1, "FuseGatheredGates": 4},
        "qwen2_moe": {
            "PlaceShapeOnHost": 2,
            "StripBookendViews": 1,
            "FuseGatheredGates": 4,
            "FuseSplitGates": 2,
            "SinkViewsPastEpilogues": 2,
        },
    }
)
# FuseAttention (issue #41): both layers' attention, from both exporters; the families with a
# symbolic sequence only (ViT's and the Whisper encoder's are static and short: under the size
# gate of tvm_fusion.transform.fuse_attention, unfused is faster)
for _family in (
    "bert_mlm",
    "clip_text",
    "distilbert",
    "distilbert_labels",
    "gpt2",
    "gpt2_labels",
    "gpt_neox",
    "llama",
    "mistral",
    "mixtral",
    "opt",
    "phi3",
    "qwen2",
    "qwen2_moe",
):
    EXPECT[_family]["FuseAttention"] = 2
# known gaps, strict: the test fails once the pass fires there, so this list stays true
GAPS = {}
# rewrites per pass counted while test_imports_compiles_matches_onnxruntime compiled a model:
# the same passes on the same import as fusion_report's grouping, so the fire check of a family
# without a "kernels" bound reuses them instead of compiling the model twice more
_REWRITES: dict[str, dict] = {}


def _data(key):
    entry = MANIFEST[key]
    data = np.load(CORPUS / f"{key}.npz")
    inputs = [data[f"in:{name}"] for name, _ in entry["inputs"]]
    outputs = [data[f"out:{name}"] for name in entry["outputs"]]
    return entry, inputs, outputs


def test_corpus_is_complete():
    families = {k.rsplit("_", 1)[0] for k in MODELS}
    assert families == set(EXPECT), families
    assert {k.rsplit("_", 1)[1] for k in MODELS} == {"torchscript", "dynamo"}


@pytest.mark.parametrize("key", MODELS)
def test_imports_compiles_matches_onnxruntime(key):
    entry, inputs, expected = _data(key)
    mod = load_onnx(CORPUS / entry["file"])
    with collect_rewrites() as counts:
        outputs, _ = run(mod, inputs)
    _REWRITES[key] = dict(counts)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key", MODELS)
def test_our_passes_fire(key, request):
    if key in GAPS:
        request.applymarker(pytest.mark.xfail(reason=GAPS[key], strict=True))
    entry = MANIFEST[key]
    expect = EXPECT[key.rsplit("_", 1)[0]]
    if "kernels" not in expect:
        rewrites = _REWRITES.get(key)
        if rewrites is None:
            with collect_rewrites() as counts:
                analysis.grouped(load_onnx(CORPUS / entry["file"]), tvm_fusion.host_target(), True)
            rewrites = dict(counts)
        for what, least in expect.items():
            assert rewrites.get(what, 0) >= least, (what, rewrites)
        return
    report = analysis.fusion_report(load_onnx(CORPUS / entry["file"]), tvm_fusion.host_target())
    for what, least in expect.items():
        if what == "kernels":
            assert report.ours_kernels <= least, report.to_text()
            assert report.stock_kernels > report.ours_kernels, report.to_text()
        else:
            assert report.rewrites.get(what, 0) >= least, (what, report.rewrites)


# one export of each family, each exporter once (the import paths both exporters share are in
# test_imports_compiles_matches_onnxruntime)
@pytest.mark.parametrize("key", ["distilbert_dynamo", "bert_mlm_torchscript"])
def test_static_shape_import_reports_and_matches(key):
    """``load_onnx(..., shapes=...)`` at the saved inputs' sizes: the fusion report works (its
    stock side lowered a DistilBERT import with a shapeless matmul and raised; the static
    import failed before that in stock's Expand of a shape value) and the numbers match."""
    entry, inputs, expected = _data(key)
    shapes = {name: list(shape) for name, shape in entry["inputs"]}
    mod = load_onnx(CORPUS / entry["file"], shapes=shapes)
    report = analysis.fusion_report(mod, tvm_fusion.host_target(), name=key)
    assert report.ours_kernels and not report.fallback, report.to_text()
    outputs, _ = run(mod, inputs)
    for got, want in zip(outputs, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
