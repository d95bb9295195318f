"""A BERT-style sequence classifier with labels (issue #40), written in torch: token and
position embeddings (``position_ids[:, :seq]`` of a buffer, as transformers' BERT), LayerNorm,
two encoder layers (2-head attention with a padding mask, GELU MLP), a tanh pooler on token 0
and a 5-class head; ``forward(input_ids, attention_mask, labels)`` returns ``(loss, logits)``
with ``CrossEntropyLoss()(logits.view(-1, num_labels), labels.view(-1))`` as
``BertForSequenceClassification`` writes it. Exported with ``torch.export`` (dynamic batch and
sequence), the dynamo ONNX exporter and the TorchScript one (dynamic batch), imported,
compiled with the tvm_fusion pipeline on the host and compared with torch at several batch
sizes of one symbolic-batch import.

The ``torch.export`` program with a dynamic sequence failed to import (``logits.view(-1, 5)``:
"Reshape expects the input tensor to have known shape"): the position ids' slice to the
symbolic ``seq`` was declared ``T.min(seq, 16)`` long, so everything after the embeddings' sum
lost its shape (``torch_ops_extra``'s ``slice.Tensor``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvm_fusion.build import engine
from tvm_fusion.frontend import import_exported_program, load_onnx
from tvm_fusion.target import host_target
from tvm_fusion.transform import collect_rewrites

torch = pytest.importorskip("torch")
nn = torch.nn

VOCAB, HIDDEN, HEADS, MAX_POS, LABELS, SEQ = 50, 32, 2, 16, 5, 8
NAMES = ["input_ids", "attention_mask", "labels"]


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x, bias):
        b, s, h = x.shape
        d = h // HEADS
        q, k, v = (p(x).view(b, s, HEADS, d).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.out(ctx))
        return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))


class SeqClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(MAX_POS, HIDDEN)
        self.register_buffer("position_ids", torch.arange(MAX_POS)[None], persistent=False)
        self.ln = nn.LayerNorm(HIDDEN)
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.pool, self.classifier = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, LABELS)

    def forward(self, input_ids, attention_mask, labels):
        seq = input_ids.shape[1]
        x = self.ln(self.tok(input_ids) + self.pos(self.position_ids[:, :seq]))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, bias)
        logits = self.classifier(torch.tanh(self.pool(x[:, 0])))
        loss = nn.CrossEntropyLoss()(logits.view(-1, LABELS), labels.view(-1))
        return loss, logits


def _model():
    torch.manual_seed(0)
    return SeqClassifier().eval()


def _inputs(batch, seq=SEQ):
    g = torch.Generator().manual_seed(batch * 100 + seq)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(batch):
        mask[row, seq - row % (seq - 1) :] = 0  # row 0 unpadded, then 1, 2 ... padded tokens
    labels = torch.randint(0, LABELS, (batch,), generator=g)
    return ids, mask, labels


def _matches_torch(mod, model, sizes):
    """One compilation of ``mod`` (tvm_fusion, host) run at each (batch, seq) of ``sizes``."""
    compiled = engine.compile_module(mod, host_target(), "tvm_fusion")
    for batch, seq in sizes:
        args = _inputs(batch, seq)
        with torch.no_grad():
            want = [t.numpy() for t in model(*args)]
        got = engine.TvmRunner(compiled, [a.numpy() for a in args]).outputs()
        assert len(got) == 2
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def _exported(model, dynamic_seq):
    batch = torch.export.Dim("batch", max=64)
    tokens = (
        {0: batch, 1: torch.export.Dim("seq", min=2, max=MAX_POS)} if dynamic_seq else {0: batch}
    )
    dims = (tokens, tokens, {0: batch})
    return torch.export.export(model, _inputs(2), dynamic_shapes=dims)


def test_torch_export_dynamic_batch_and_sequence():
    """The regression: the position ids' slice to a symbolic ``seq`` kept its length ``seq``,
    so the loss's views import; one import at batch 1, 3, 7 and two sequence lengths, and the
    cross-entropy loss fused."""
    model = _model()
    mod = import_exported_program(_exported(model, dynamic_seq=True))
    text = mod["main"].script()
    assert "T.min" not in text, text  # the slice is declared (1, seq), not (1, min(seq, 16))
    with collect_rewrites() as counts:
        _matches_torch(mod, model, [(1, SEQ), (3, 5), (7, SEQ)])
    assert counts["FuseCrossEntropy"] >= 1, dict(counts)


def test_torch_export_without_decompositions():
    model = _model()
    program = _exported(model, dynamic_seq=True)
    mod = import_exported_program(program, decompose=False)
    _matches_torch(mod, model, [(3, SEQ), (7, 6)])


def test_torch_export_dynamic_batch_saved(tmp_path):
    from tvm_fusion.frontend import load_model

    model = _model()
    path = tmp_path / "seq_classifier.pt2"
    torch.export.save(_exported(model, dynamic_seq=False), str(path))
    _matches_torch(load_model(path), model, [(1, SEQ), (7, SEQ)])


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_exporters_dynamic_batch(tmp_path, dynamo):
    model = _model()
    path = tmp_path / "seq_classifier.onnx"
    kwargs = {"input_names": NAMES, "output_names": ["loss", "logits"]}
    if dynamo:
        pytest.importorskip("onnxscript")
        batch = torch.export.Dim("batch", max=64)
        shapes = ({0: batch}, {0: batch}, {0: batch})
        kwargs.update(dynamo=True, dynamic_shapes=shapes, external_data=False, optimize=True)
    else:
        axes = {name: {0: "batch"} for name in [*NAMES, "logits"]}
        kwargs.update(dynamo=False, dynamic_axes=axes, opset_version=17)
    with torch.no_grad():
        torch.onnx.export(model, _inputs(2), str(path), **kwargs)
    mod = load_onnx(path)
    with collect_rewrites() as counts:
        _matches_torch(mod, model, [(1, SEQ), (3, SEQ), (7, SEQ)])
    assert counts["FuseCrossEntropy"] >= 1, dict(counts)
