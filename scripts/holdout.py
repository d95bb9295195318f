#!/usr/bin/env python3
"""Held-out check through the users' main path: ``torch.export`` -> ``torch.export.save`` ->
``tvm_fusion.load_model`` (TVM's ``from_exported_program``) -> ``tvm.compile(...,
relax_pipeline="tvm_fusion")`` on llvm, for the corpus architectures (the builders of
``scripts/export_corpus.py``) and architectures the corpus does not have, at awkward sizes
(vocabulary 1031, hidden 40, inner 76, one layer; run at batch 3 x seq 13 and batch 1 x seq 77
through one dynamic-shape build where the export allows a dynamic batch / sequence ``Dim``).

Per model it records: exported with dynamic dims?, imports?, compiles (ours and stock TVM's
default pipeline)?, the largest error against PyTorch eager (ours and stock), kernels, kernels
left to the fallback schedule rule, and the rewrites of our passes. Needs torch and
transformers (not project dependencies; configs are built in code, no downloads).

Two phases, so that timings are taken apart from the compiles (the machine is shared):

    python scripts/holdout.py                  # compile + check all (work dir bench/holdout/)
    python scripts/holdout.py bart gemma       # ... some models (again: --force)
    python scripts/holdout.py --time           # time the saved builds, stock vs ours
    python scripts/holdout.py --report         # bench/holdout.{md,json} from the work dir

A model whose process died (a crash inside TVM) is recorded as such on the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import export_corpus as corpus  # noqa: E402

WORK = ROOT / "bench" / "holdout"
RTOL = ATOL = 1e-3  # as bench --models: relative to the largest |reference| (at least 1)
EXPORT_SHAPE = (2, 5)
CHECK_SHAPES = [(3, 13), (1, 77)]
HOLD = dataclasses.replace(
    corpus.SCALES["test"],
    out=WORK,
    vocab=1031,
    hidden=40,
    inner=76,
    layers=1,
    heads=2,
    kv_heads=2,
    max_pos=128,
    cell_in=20,
    cell_hidden=44,
)
PASSES = (
    "place_shape_on_host",
    "gather_to_slice",
    "fuse_split_gates",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
)


# ---------------------------------------------------------------------------------------------
# architectures the corpus does not have (same contract as export_corpus's builders:
# (module, inputs(b, s), output names, dynamic axes, patterns))


def _tokens(b, s):
    return corpus._tokens(b, s)


def _ids_mask(b, s):
    return {"input_ids": _tokens(b, s), "attention_mask": corpus._padded_mask(b, s)}


DYN = {0: "batch", 1: "seq"}


def _encoder(model, names=("input_ids", "attention_mask"), patterns=()):
    wrap = corpus._hidden_only(model, list(names))
    axes = {n: DYN for n in names}

    def inputs(b, s):
        feeds = _ids_mask(b, s)
        if "decoder_input_ids" in names:
            feeds["decoder_input_ids"] = _tokens(b, s)
        return {n: feeds[n] for n in names}

    return wrap, inputs, ["hidden"], axes, list(patterns)


def _cfg(cls, **kw):
    return cls(attn_implementation="eager", **kw)


def bart():
    from transformers import BartConfig, BartModel

    S = corpus.S
    cfg = _cfg(
        BartConfig,
        vocab_size=S.vocab,
        d_model=S.hidden,
        encoder_layers=S.layers,
        decoder_layers=S.layers,
        encoder_attention_heads=S.heads,
        decoder_attention_heads=S.heads,
        encoder_ffn_dim=S.inner,
        decoder_ffn_dim=S.inner,
        max_position_embeddings=S.max_pos,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
    )
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    return _encoder(BartModel(cfg).eval(), names, ["encoder-decoder, learned positions"])


def roberta_mlm():
    from transformers import RobertaConfig, RobertaForMaskedLM

    S = corpus.S
    cfg = _cfg(
        RobertaConfig,
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        max_position_embeddings=S.max_pos + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = corpus._masked_lm(RobertaForMaskedLM(cfg).eval())

    def inputs(b, s):
        labels = _tokens(b, s)
        labels[:, ::3] = -100
        ids = _tokens(b, s).clamp(min=2)  # 1 is RoBERTa's padding id (positions skip it)
        return {"input_ids": ids, "attention_mask": corpus._padded_mask(b, s), "labels": labels}

    axes = {"input_ids": DYN, "attention_mask": DYN, "labels": DYN}
    return model, inputs, ["loss", "logits"], axes, ["fuse_cross_entropy (MLM loss)"]


def albert():
    from transformers import AlbertConfig, AlbertModel

    S = corpus.S
    cfg = _cfg(
        AlbertConfig,
        vocab_size=S.vocab,
        embedding_size=24,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        max_position_embeddings=S.max_pos,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _encoder(AlbertModel(cfg).eval(), patterns=["factorised embedding, gelu_new"])


def mobilebert():
    from transformers import MobileBertConfig, MobileBertModel

    S = corpus.S
    cfg = _cfg(
        MobileBertConfig,
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        embedding_size=24,
        intra_bottleneck_size=20,
        true_hidden_size=20,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        num_feedforward_networks=2,
        max_position_embeddings=S.max_pos,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _encoder(MobileBertModel(cfg).eval(), patterns=["bottlenecks, NoNorm"])


def _decoder_lm(config_cls, model_cls, pattern: str, left_pad=False, **kw):
    """A decoder-only LM from ``corpus._lm_config(config_cls, **kw)``, with its pattern."""
    cfg = corpus._lm_config(config_cls, **kw)
    wrap = corpus._causal_lm(model_cls(cfg).eval(), left_pad=left_pad)
    return (*wrap[:4], [pattern])


def gemma():
    """Gemma: GeGLU with the tanh GELU, RMSNorm (1 + w), embeddings scaled by sqrt(hidden)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    S = corpus.S
    return _decoder_lm(
        GemmaConfig,
        GemmaForCausalLM,
        "fuse_split_gates (GeGLU, tanh GELU, sibling linears)",
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=2 * S.kv_heads,
        num_key_value_heads=S.kv_heads,
        head_dim=10,
        hidden_activation="gelu_pytorch_tanh",
    )


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    S = corpus.S
    return _decoder_lm(
        BloomConfig,
        BloomForCausalLM,
        "ALiBi from a cumsum of the mask",
        left_pad=True,
        hidden_size=S.hidden,
        n_layer=S.layers,
        n_head=S.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    S = corpus.S
    return _decoder_lm(
        GPTJConfig,
        GPTJForCausalLM,
        "interleaved rotary, parallel attention + MLP",
        n_embd=S.hidden,
        n_inner=S.inner,
        n_layer=S.layers,
        n_head=S.heads,
        n_positions=S.max_pos,
        rotary_dim=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _vision(model_cls, config, size):
    import torch

    model = model_cls(config).eval()
    wrap = corpus._hidden_only(model, ["pixel_values"])

    def inputs(b, _s):
        return {"pixel_values": torch.randn(b, 3, size, size)}

    return wrap, inputs, ["hidden"], {"pixel_values": {0: "batch"}}, ["convolutions, batch dim"]


def resnet():
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=12, hidden_sizes=[12, 20], depths=[1, 1], layer_type="basic")
    return _vision(ResNetModel, cfg, 37)


def convnext():
    from transformers import ConvNextConfig, ConvNextModel

    cfg = ConvNextConfig(hidden_sizes=[12, 20], depths=[1, 1], num_stages=2)
    return _vision(ConvNextModel, cfg, 36)


def _mlp_model(forward_gate, gates: int, pattern: str):
    import torch

    S = corpus.S

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(S.hidden, gates * S.inner)
            self.down = torch.nn.Linear(S.inner, S.hidden, bias=False)

        def forward(self, x):
            return self.down(forward_gate(self.up(x)))

    def inputs(b, s):
        return {"x": torch.randn(b, s, S.hidden)}

    return MLP().eval(), inputs, ["y"], {"x": DYN}, [pattern]


def geglu_split():
    """GeGLU, erf GELU, gate and up as ``split(inner)``."""
    import torch

    def gate(h):
        a, b = h.split(corpus.S.inner, dim=-1)
        return torch.nn.functional.gelu(a) * b

    return _mlp_model(gate, 2, "fuse_split_gates (GeGLU erf, split)")


def geglu_tanh_unbind():
    """GeGLU with the tanh GELU, gate and up as ``view(..., 2, inner).unbind(-2)``."""
    import torch

    def gate(h):
        a, b = h.unflatten(-1, (2, corpus.S.inner)).unbind(-2)
        return torch.nn.functional.gelu(a, approximate="tanh") * b

    return _mlp_model(gate, 2, "fuse_split_gates (GeGLU tanh, unbind)")


def swiglu_sigmoid():
    """SwiGLU spelled ``a * sigmoid(a) * b`` over ``chunk(2)``."""
    import torch

    def gate(h):
        a, b = h.chunk(2, dim=-1)
        return a * torch.sigmoid(a) * b

    return _mlp_model(gate, 2, "fuse_split_gates (x * sigmoid(x) * y)")


def ce_head():
    """An LM head with ``F.cross_entropy(label_smoothing, ignore_index, reduction="sum")``."""
    import torch

    S = corpus.S

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(S.hidden, S.vocab, bias=False)

        def forward(self, x, labels):
            logits = self.head(x)
            return torch.nn.functional.cross_entropy(
                logits.flatten(0, 1),
                labels.flatten(),
                ignore_index=3,
                label_smoothing=0.1,
                reduction="sum",
            )

    def inputs(b, s):
        labels = _tokens(b, s)
        labels[:, ::4] = 3
        return {"x": torch.randn(b, s, S.hidden), "labels": labels}

    axes = {"x": DYN, "labels": DYN}
    return Head().eval(), inputs, ["loss"], axes, ["fuse_cross_entropy (smoothing, ignore, sum)"]


# --- branch holdout36: more held-out architectures ---


def swin():
    """Swin: window attention with a shifted window (roll), padding to the window size."""
    from transformers import SwinConfig, SwinModel

    cfg = SwinConfig(
        image_size=36,
        patch_size=4,
        embed_dim=12,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=4,
        mlp_ratio=2.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return _vision(SwinModel, cfg, 36)


def mobilenet_v2():
    """MobileNetV2: depthwise convolutions, inverted residuals, ReLU6, odd image size."""
    import torch
    from transformers import MobileNetV2Config, MobileNetV2Model

    cfg = MobileNetV2Config(image_size=37, depth_multiplier=0.35, classifier_dropout_prob=0.0)
    model, inputs, outs, axes, patterns = _vision(MobileNetV2Model, cfg, 37)
    # transformers' init (std 0.02) shrinks the activations to ~1e-30 over 17 blocks; He init
    # keeps them near 1, so that the comparison with torch means something
    for module in model.m.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    return model, inputs, outs, axes, patterns


def segformer():
    """SegFormer: overlapping patch embeddings, efficient (reduced) attention, Mix-FFN."""
    from transformers import SegformerConfig, SegformerModel

    cfg = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[12, 20],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return _vision(SegformerModel, cfg, 37)


def wav2vec2():
    """Wav2Vec2: conv feature extractor with group norm, positional grouped conv, encoder."""
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    S = corpus.S
    cfg = _cfg(
        Wav2Vec2Config,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=6,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        apply_spec_augment=False,
    )
    wrap = corpus._hidden_only(Wav2Vec2Model(cfg).eval(), ["input_values"])

    def inputs(b, _s):
        return {"input_values": torch.randn(b, 267)}  # a fixed length: 52 then 26 frames

    axes = {"input_values": {0: "batch"}}
    return wrap, inputs, ["hidden"], axes, ["conv feature extractor, group norm, pos conv"]


def llama_gqa5():
    """Llama with grouped-query attention at an odd head count: 5 query heads, 1 KV head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    S = corpus.S
    return _decoder_lm(
        LlamaConfig,
        LlamaForCausalLM,
        "GQA 5:1, odd head count",
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=8,
    )


def marian():
    """Marian: encoder-decoder with sinusoidal positions, scaled embeddings."""
    from transformers import MarianConfig, MarianModel

    S = corpus.S
    cfg = _cfg(
        MarianConfig,
        vocab_size=S.vocab,
        decoder_vocab_size=S.vocab,
        d_model=S.hidden,
        encoder_layers=S.layers,
        decoder_layers=S.layers,
        encoder_attention_heads=S.heads,
        decoder_attention_heads=S.heads,
        encoder_ffn_dim=S.inner,
        decoder_ffn_dim=S.inner,
        max_position_embeddings=S.max_pos,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        use_cache=False,
    )
    names = ("input_ids", "attention_mask", "decoder_input_ids")
    return _encoder(MarianModel(cfg).eval(), names, ["encoder-decoder, sinusoidal positions"])


def electra():
    """ELECTRA discriminator: embedding size below hidden (projection), GELU."""
    from transformers import ElectraConfig, ElectraModel

    S = corpus.S
    cfg = _cfg(
        ElectraConfig,
        vocab_size=S.vocab,
        embedding_size=24,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        max_position_embeddings=S.max_pos,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _encoder(ElectraModel(cfg).eval(), patterns=["embedding projection"])


def gpt_bigcode():
    """GPT-BigCode: multi-query attention with a fused c_attn, learned positions."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    S = corpus.S
    return _decoder_lm(
        GPTBigCodeConfig,
        GPTBigCodeForCausalLM,
        "multi-query attention, fused c_attn",
        n_embd=S.hidden,
        n_inner=S.inner,
        n_layer=S.layers,
        n_head=S.heads,
        n_positions=S.max_pos,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def stablelm():
    """StableLM: partial rotary (40%: 8 of 20 head dims), LayerNorm, SwiGLU."""
    from transformers import StableLmConfig, StableLmForCausalLM

    S = corpus.S
    return _decoder_lm(
        StableLmConfig,
        StableLmForCausalLM,
        "partial rotary, LayerNorm",
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        num_key_value_heads=S.kv_heads,
        partial_rotary_factor=0.4,
    )


def olmo():
    """OLMo: LayerNorm without affine parameters, SwiGLU, RoPE."""
    from transformers import OlmoConfig, OlmoForCausalLM

    S = corpus.S
    return _decoder_lm(
        OlmoConfig,
        OlmoForCausalLM,
        "non-parametric LayerNorm",
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        num_key_value_heads=S.kv_heads,
    )


def persimmon():
    """Persimmon: qk LayerNorm, partial rotary (50%), squared ReLU, fused qkv."""
    from transformers import PersimmonConfig, PersimmonForCausalLM

    S = corpus.S
    return _decoder_lm(
        PersimmonConfig,
        PersimmonForCausalLM,
        "qk LayerNorm, partial rotary, relu2",
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        partial_rotary_factor=0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


NEW = {
    "bart": bart,
    "roberta_mlm": roberta_mlm,
    "albert": albert,
    "mobilebert": mobilebert,
    "gemma": gemma,
    "bloom": bloom,
    "gptj": gptj,
    "resnet": resnet,
    "convnext": convnext,
    "geglu_split": geglu_split,
    "geglu_tanh_unbind": geglu_tanh_unbind,
    "swiglu_sigmoid": swiglu_sigmoid,
    "ce_head": ce_head,
    "swin": swin,
    "mobilenet_v2": mobilenet_v2,
    "segformer": segformer,
    "wav2vec2": wav2vec2,
    "llama_gqa5": llama_gqa5,
    "marian": marian,
    "electra": electra,
    "gpt_bigcode": gpt_bigcode,
    "stablelm": stablelm,
    "olmo": olmo,
    "persimmon": persimmon,
}
MODELS = {**corpus.MODELS, **NEW}


# ---------------------------------------------------------------------------------------------
# one model: export, import, compile, compare


def _flat(out) -> list[np.ndarray]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out.detach().numpy()]
    flat: list[np.ndarray] = []
    for item in out:
        flat.extend(_flat(item))
    return flat


def _rel_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Largest |got - want| over max(1, largest |want|), over all outputs."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, "float64"), np.asarray(w, "float64")
        if g.shape != w.shape:
            return float("inf")
        if w.size:
            scale = max(1.0, float(np.abs(w).max()))
            worst = max(worst, float(np.abs(g - w).max()) / scale)
    return worst


def _export(module, example: dict, axes: dict):
    """torch.export with the model's dynamic axes as Dims; the static export if they fail."""
    import torch
    from torch.export import Dim

    dims: dict[str, Dim] = {}
    shapes = {}
    for name in example:
        spec = {
            a: dims.setdefault(n, Dim(n, min=1, max=HOLD.max_pos))
            for a, n in axes.get(name, {}).items()
        }
        shapes[name] = spec or None
    with torch.no_grad():
        try:
            return torch.export.export(module, tuple(example.values()), dynamic_shapes=shapes), ""
        except Exception as err:  # noqa: BLE001 - recorded, then the static export
            why = _line(err)
    return None, why


def _line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:240] if text else ''}"


def run_one(name: str) -> dict:
    import torch

    import tvm_fusion
    from tvm_fusion import analysis
    from tvm_fusion.build import engine
    from tvm_fusion.transform import collect_rewrites

    corpus.S = HOLD
    corpus._seed()
    module, make_inputs, _outs, axes, patterns = MODELS[name]()
    rec: dict = {"name": name, "corpus": name in corpus.MODELS, "patterns": patterns}
    dynamic = any(axes.get(n) for n in make_inputs(*EXPORT_SHAPE))
    program, why = _export(module, make_inputs(*EXPORT_SHAPE), axes) if dynamic else (None, "")
    shapes = CHECK_SHAPES
    if program is None:
        rec["dynamic_export"] = why or "no dynamic axis"
        shapes = CHECK_SHAPES[:1]
        with torch.no_grad():
            try:
                program = torch.export.export(module, tuple(make_inputs(*shapes[0]).values()))
            except Exception as err:  # noqa: BLE001
                rec["stage"] = f"torch.export: {_line(err)}"
                return rec
    else:
        rec["dynamic_export"] = "yes"
    feeds = [make_inputs(*s) for s in shapes]
    rec["check_inputs"] = [{k: list(v.shape) for k, v in f.items()} for f in feeds]
    with torch.no_grad():
        want = [_flat(module(*f.values())) for f in feeds]
    pt2 = WORK / f"{name}.pt2"
    torch.export.save(program, str(pt2))
    try:
        mod = tvm_fusion.load_model(pt2)
    except Exception as err:  # noqa: BLE001
        rec["stage"] = f"import: {_line(err)}"
        return rec
    finally:
        pt2.unlink(missing_ok=True)
    target = tvm_fusion.host_target()
    arrays = [[v.numpy() for v in f.values()] for f in feeds]
    np.savez(WORK / f"{name}.npz", *arrays[0])
    for pipeline in ("tvm_fusion", "stock"):
        key = "ours" if pipeline == "tvm_fusion" else "stock"
        start = time.perf_counter()
        try:
            with collect_rewrites() as counts:
                compiled = engine.compile_module(mod, target, pipeline)
        except Exception as err:  # noqa: BLE001
            rec[key] = {"error": f"compile: {_line(err)}"}
            continue
        entry = {"compile_s": round(time.perf_counter() - start, 1)}
        entry["kernels"] = analysis.kernel_count(compiled.lowered)
        entry["fallback"] = analysis.fallback_kernels(compiled.lowered)
        if pipeline == "tvm_fusion":
            entry["rewrites"] = {k: v for k, v in dict(counts).items() if v}
        try:
            errors = []
            for feed, ref in zip(arrays, want, strict=True):
                got = engine.TvmRunner(compiled, feed).outputs()
                errors.append(_rel_error(got, ref))
            entry["max_rel_err"] = max(errors)
            entry["ok"] = entry["max_rel_err"] <= ATOL
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"run: {_line(err)}"
        compiled.executable.export_library(str(WORK / f"{name}.{key}.so"))
        rec[key] = entry
    rec["stage"] = "done"
    return rec


# ---------------------------------------------------------------------------------------------
# timing the saved builds


def time_one(name: str, rec: dict, repeat: int, budget_s: float) -> dict:
    import tvm
    from tvm import relax

    from tvm_fusion.build import engine

    saved = np.load(WORK / f"{name}.npz")
    runs = {}
    for key in ("stock", "ours"):
        lib = WORK / f"{name}.{key}.so"
        if not lib.exists() or not rec.get(key, {}).get("ok"):
            continue
        dev = tvm.cpu()
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib)), dev)
        args = [tvm.runtime.tensor(saved[f"arr_{i}"], dev) for i in range(len(saved.files))]
        main = vm["main"]
        runs[key] = lambda main=main, args=args: main(*args)
    if len(runs) < 2:
        return {}
    timing = engine.time_interleaved(runs, repeat=repeat, budget_s=budget_s, rounds=3)
    return {k: round(v["median_ms"], 3) for k, v in timing.items()}


# ---------------------------------------------------------------------------------------------
# report


def _load(name: str) -> dict | None:
    path = WORK / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return entry["error"][:90].replace("|", "/")
    mark = "ok" if entry.get("ok") else "**WRONG**"
    return f"{mark} {entry['max_rel_err']:.1e}"


def report(names: list[str], output: Path) -> None:
    rows, summary = [], {"models": 0, "imported": 0, "ours_ok": 0, "stock_ok": 0}
    summary.update(fallback_kernels=0, dynamic=0)
    results = {}
    for name in names:
        rec = _load(name)
        if rec is None:
            continue
        results[name] = rec
        summary["models"] += 1
        ours, stock = rec.get("ours"), rec.get("stock")
        imported = rec.get("stage") == "done"
        summary["imported"] += imported
        summary["dynamic"] += rec.get("dynamic_export") == "yes"
        summary["ours_ok"] += bool(ours and ours.get("ok"))
        summary["stock_ok"] += bool(stock and stock.get("ok"))
        summary["fallback_kernels"] += len((ours or {}).get("fallback", []))
        timing = rec.get("timing_ms", {})
        ratio = "-"
        if "ours" in timing and "stock" in timing:
            ours_ms, stock_ms = timing["ours"], timing["stock"]
            ratio = f"{ours_ms / stock_ms:.2f}x ({ours_ms:.2f} / {stock_ms:.2f})"
        rewrites = ", ".join(f"{k} {v}" for k, v in (ours or {}).get("rewrites", {}).items())
        dyn = "dyn" if rec.get("dynamic_export") == "yes" else "static"
        rows.append(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                name + ("" if name in corpus.MODELS else " (new)"),
                dyn,
                "yes" if imported else rec.get("stage", "?")[:90].replace("|", "/"),
                _cell(ours),
                _cell(stock),
                f"{(ours or {}).get('kernels', '-')} / {(stock or {}).get('kernels', '-')}",
                len((ours or {}).get("fallback", [])) if ours and "kernels" in ours else "-",
                rewrites or "-",
                ratio,
            )
        )
    header = [
        "# Held-out check: torch.export -> from_exported_program -> tvm_fusion (llvm)",
        "",
        "`python scripts/holdout.py` then `python scripts/holdout.py --time` (quiet).",
        f"Sizes: vocab {HOLD.vocab}, hidden {HOLD.hidden}, inner {HOLD.inner}, "
        f"{HOLD.layers} layer, heads {HOLD.heads}; exported at (batch, seq) = {EXPORT_SHAPE} "
        f"with dynamic Dims, checked at {CHECK_SHAPES} against PyTorch eager (static exports: "
        f"the first only). Error: max |tvm - torch| / max(1, max |torch|), ok <= {ATOL}.",
        "",
        "Summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()),
        "",
        "| model | export | imports | ours vs torch | stock vs torch | kernels ours / stock "
        "| fallback (ours) | rewrites (ours) | time ours / stock (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = [
        f"- {n}: dynamic export failed, static: {r['dynamic_export']}"
        for n, r in results.items()
        if r.get("dynamic_export") not in ("yes", None)
    ]
    text = "\n".join(header + rows) + "\n"
    if not any(r.get("timing_ms") for r in results.values()):
        text += "\nTimes: not measured in this run (`--time` not run).\n"
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    output.with_suffix(".md").write_text(text)
    output.with_suffix(".json").write_text(
        json.dumps({"summary": summary, "models": results}, indent=1, sort_keys=True) + "\n"
    )
    print(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"default: all ({', '.join(MODELS)})")
    parser.add_argument("--force", action="store_true", help="redo models already checked")
    parser.add_argument("--time", action="store_true", help="time the saved builds")
    parser.add_argument("--report", action="store_true", help="only write the report")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timed runs each")
    parser.add_argument("--output", default=str(ROOT / "bench" / "holdout.md"))
    args = parser.parse_args(argv)
    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}")
    WORK.mkdir(parents=True, exist_ok=True)
    if not args.report:
        import logging

        logging.getLogger("torch").setLevel(logging.ERROR)
        warnings.simplefilter("ignore")
        if args.time:
            load = os.getloadavg()
            print(f"load at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
        for name in names:
            rec = _load(name)
            if args.time:
                if rec and rec.get("stage") == "done":
                    rec["timing_ms"] = time_one(name, rec, args.repeat, args.budget)
                    rec["timing_load"] = round(os.getloadavg()[0], 2)
                    (WORK / f"{name}.json").write_text(json.dumps(rec, indent=1))
                    print(f"{name}: {rec['timing_ms']}", flush=True)
                continue
            if rec and not args.force:
                if rec.get("stage") == "started":
                    rec["stage"] = "crashed (the process died)"
                    (WORK / f"{name}.json").write_text(json.dumps(rec, indent=1))
                continue
            (WORK / f"{name}.json").write_text(json.dumps({"name": name, "stage": "started"}))
            start = time.perf_counter()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    rec = run_one(name)
            except Exception as err:  # noqa: BLE001 - a builder or harness failure, recorded
                traceback.print_exc()
                rec = {"name": name, "corpus": name in corpus.MODELS, "stage": _line(err)}
            rec["seconds"] = round(time.perf_counter() - start, 1)
            (WORK / f"{name}.json").write_text(json.dumps(rec, indent=1))
            print(f"{name}: {rec.get('stage')} {rec.get('seconds')} s", flush=True)
    report(list(MODELS), Path(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
