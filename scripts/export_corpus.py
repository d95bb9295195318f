#!/usr/bin/env python3
"""Export the real-model corpus: small transformers / torch.nn models to ONNX under tests/corpus.

Needs torch, transformers and onnxscript (not project dependencies: CI reads the checked-in
files). Every model is built from a small config in code with random weights (no hub
downloads), exported with the TorchScript exporter (``dynamo=False``) and, where it works, the
dynamo exporter, with dynamic batch/sequence axes. For each export this writes

    tests/corpus/NAME.onnx    the model (weights inside; the exporters' per-node metadata,
                              stack traces with local paths, dropped)
    tests/corpus/NAME.npz     inputs ("in:NAME") at shapes other than the export's, and ONNX
                              Runtime's outputs ("out:NAME") on them
and tests/corpus/manifest.json: per model its exporter, inputs, dynamic axes, and what the
patterns in it are (which of our passes should fire), or why an export was skipped.

    python scripts/export_corpus.py            # all
    python scripts/export_corpus.py gpt2 lstm_cell
    python scripts/export_corpus.py --scale bench   # larger configs to bench/models (not in git)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPSET = {"torchscript": 17, "dynamo": 18}  # the dynamo exporter starts at 18


@dataclasses.dataclass(frozen=True)
class Scale:
    """Model sizes: ``test`` is the checked-in corpus (tiny, fast in CI); ``bench`` is for
    ``tvm-fusion bench --models`` (not checked in: ~90 MB)."""

    out: Path
    vocab: int
    hidden: int
    inner: int
    layers: int
    heads: int
    kv_heads: int
    max_pos: int
    cell_in: int
    cell_hidden: int
    export_shape: tuple[int, int]  # batch, sequence at export
    check_shape: tuple[int, int]  # saved inputs: other sizes, so the dynamic axes are exercised


SCALES = {
    "test": Scale(ROOT / "tests" / "corpus", 128, 32, 64, 2, 2, 2, 64, 32, 48, (2, 5), (3, 7)),
    "bench": Scale(
        ROOT / "bench" / "models", 8192, 256, 1024, 2, 4, 2, 256, 512, 512, (2, 5), (4, 128)
    ),
}
S = SCALES["test"]


def _seed():
    import torch

    torch.manual_seed(0)
    np.random.seed(0)


def _tokens(batch, seq):
    import torch

    return torch.randint(0, S.vocab, (batch, seq), dtype=torch.int64)


def xlnet():
    import torch
    from transformers import XLNetConfig, XLNetModel

    cfg = XLNetConfig(
        vocab_size=S.vocab,
        d_model=S.hidden,
        n_layer=S.layers,
        n_head=S.heads,
        d_inner=S.inner,
        dropout=0.0,
    )
    model = XLNetModel(cfg).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_mems=False, return_dict=False)[0]

    def inputs(b, s):
        return {"input_ids": _tokens(b, s)}

    axes = {"input_ids": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"}}
    return Wrap(), inputs, ["hidden"], axes, ["gather_to_slice (rel_shift index_select)"]


def bert_mlm():
    import torch
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        max_position_embeddings=S.max_pos,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = _masked_lm(BertForMaskedLM(cfg).eval())

    def inputs(b, s):
        labels = _tokens(b, s)
        labels[:, ::3] = -100  # unmasked positions: ignore_index
        mask = torch.ones(b, s, dtype=torch.int64)
        mask[0, -1] = 0
        return {"input_ids": _tokens(b, s), "attention_mask": mask, "labels": labels}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "labels": dyn, "logits": dyn}
    return model, inputs, ["loss", "logits"], axes, ["fuse_cross_entropy (MLM loss)"]


def _masked_lm(model):
    """A transformers masked LM as (input_ids, attention_mask, labels) -> (loss, logits)."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, labels):
            out = self.m(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_dict=False
            )
            return out[0], out[1]

    return Wrap()


def _distilbert_config():
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=S.vocab,
        dim=S.hidden,
        n_layers=S.layers,
        n_heads=S.heads,
        hidden_dim=S.inner,
        max_position_embeddings=S.max_pos,
        dropout=0.0,
        attention_dropout=0.0,
        attn_implementation="eager",
    )


def distilbert():
    import torch
    from transformers import DistilBertModel

    cfg = _distilbert_config()
    model = DistilBertModel(cfg).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask)[0]

    def inputs(b, s):
        mask = torch.ones(b, s, dtype=torch.int64)
        mask[0, -2:] = 0
        return {"input_ids": _tokens(b, s), "attention_mask": mask}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "hidden": dyn}
    return Wrap(), inputs, ["hidden"], axes, ["position embedding of a position_ids buffer"]


def _causal_lm(model, left_pad: bool):
    """A transformers causal LM as (input_ids, attention_mask) -> logits, no cache."""
    import torch

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):
            return self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                return_dict=False,
            )[0]

    def inputs(b, s):
        mask = torch.ones(b, s, dtype=torch.int64)
        if left_pad:
            mask[-1, :2] = 0  # left padding in the last row
        return {"input_ids": _tokens(b, s), "attention_mask": mask}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "logits": dyn}
    return Wrap(), inputs, ["logits"], axes, ["place_shape_on_host (shape chains)"]


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=S.vocab,
        n_embd=S.hidden,
        n_layer=S.layers,
        n_head=S.heads,
        n_positions=S.max_pos,
        bos_token_id=None,
        eos_token_id=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="eager",
    )
    return _causal_lm(GPT2LMHeadModel(cfg).eval(), left_pad=True)


def gpt2_labels():
    """GPT-2 with labels, the loss only (a training / evaluation graph): the LM head's logits
    feed nothing but the shifted-label cross entropy, so FuseLinearCrossEntropy can chunk it."""
    import torch

    model = gpt2()[0].m

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask, labels):
            return self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                labels=labels,
                use_cache=False,
                return_dict=False,
            )[0]

    def inputs(b, s):
        ids = _tokens(b, s)
        labels = ids.clone()
        labels[-1, -2:] = -100  # padding the loss ignores
        return {
            "input_ids": ids,
            "attention_mask": torch.ones(b, s, dtype=torch.int64),
            "labels": labels,
        }

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "labels": dyn}
    patterns = ["fuse_cross_entropy + fuse_linear_cross_entropy (shifted labels, symbolic rows)"]
    return Wrap(), inputs, ["loss"], axes, patterns


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=2 * S.kv_heads,
        num_key_value_heads=S.kv_heads,
        max_position_embeddings=S.max_pos,
        use_cache=False,
        attn_implementation="eager",
    )
    return _causal_lm(LlamaForCausalLM(cfg).eval(), left_pad=False)


# Decoder-only LMs (issue #27): tiny configs as (input_ids, attention_mask) -> logits.
def _lm_config(cls, **kw):
    kw.setdefault("vocab_size", S.vocab)
    kw.setdefault("max_position_embeddings", S.max_pos)
    return cls(use_cache=False, attn_implementation="eager", **kw)


def opt():
    """OPT: learned positions from a cumsum of the attention mask (left padding exercised)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = _lm_config(
        OPTConfig,
        hidden_size=S.hidden,
        word_embed_proj_dim=S.hidden,
        ffn_dim=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    return _causal_lm(OPTForCausalLM(cfg).eval(), left_pad=True)


def _rope_lm(config_cls, model_cls, **kw):
    cfg = _lm_config(
        config_cls,
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=2 * S.kv_heads,
        num_key_value_heads=S.kv_heads,
        **kw,
    )
    return _causal_lm(model_cls(cfg).eval(), left_pad=False)


def qwen2():
    """Qwen2: Llama-like (RMSNorm, RoPE, GQA, SwiGLU) with biases on q/k/v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _rope_lm(Qwen2Config, Qwen2ForCausalLM)


def phi3():
    """Phi-3: fused qkv_proj and gate_up_proj (SwiGLU of one GEMM's two halves)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _rope_lm(Phi3Config, Phi3ForCausalLM, pad_token_id=0)


def mistral():
    """Mistral: Llama-like with sliding-window attention (window past the sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _rope_lm(MistralConfig, MistralForCausalLM, sliding_window=S.max_pos)


def mixtral():
    """Mixtral: Mistral with a sparse MoE block (router, top-2 of 4 experts, renormalised) in
    transformers' ``batched_mm`` experts form (``W[ids]`` gathers and bmm, the export-friendly
    one; the default grouped form calls a custom op no exporter handles)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _rope_lm(
        MixtralConfig,
        MixtralForCausalLM,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        experts_implementation="batched_mm",
    )


def qwen2_moe():
    """Qwen2-MoE: top-2 of 4 routed experts (not renormalised) plus a shared expert behind a
    sigmoid gate, ``batched_mm`` experts form."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return _rope_lm(
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        moe_intermediate_size=S.inner // 2,
        shared_expert_intermediate_size=S.inner,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        experts_implementation="batched_mm",
    )


def gpt_neox():
    """GPT-NeoX: fused qkv, partial rotary, parallel residual, GELU MLP."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = _lm_config(
        GPTNeoXConfig,
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return _causal_lm(GPTNeoXForCausalLM(cfg).eval(), left_pad=True)


def falcon():
    """Falcon (7B layout): multi-query attention, rotary, parallel attention + MLP."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = _lm_config(
        FalconConfig,
        hidden_size=S.hidden,
        ffn_hidden_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return _causal_lm(FalconForCausalLM(cfg).eval(), left_pad=True)


def lstm_cell():
    import torch

    cell = torch.nn.LSTMCell(S.cell_in, S.cell_hidden).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x, h, c):
            return self.cell(x, (h, c))

    def inputs(b, _s):
        x, h = torch.randn(b, S.cell_in), torch.randn(b, S.cell_hidden)
        return {"x": x, "h": h, "c": torch.randn(b, S.cell_hidden)}

    dyn = {0: "batch"}
    axes = {"x": dyn, "h": dyn, "c": dyn, "h_out": dyn, "c_out": dyn}
    return Wrap(), inputs, ["h_out", "c_out"], axes, ["fuse_split_gates (LSTM gates)"]


def gru_cell():
    import torch

    cell = torch.nn.GRUCell(S.cell_in, S.cell_hidden).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x, h):
            return self.cell(x, h)

    def inputs(b, _s):
        return {"x": torch.randn(b, S.cell_in), "h": torch.randn(b, S.cell_hidden)}

    dyn = {0: "batch"}
    axes = {"x": dyn, "h": dyn, "h_out": dyn}
    return Wrap(), inputs, ["h_out"], axes, ["fuse_split_gates (GRU gates)"]


def swiglu_chunk():
    import torch

    class SwiGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(S.hidden, 2 * S.inner, bias=False)
            self.down = torch.nn.Linear(S.inner, S.hidden, bias=False)

        def forward(self, x):
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(torch.nn.functional.silu(gate) * up)

    def inputs(b, s):
        return {"x": torch.randn(b, s, S.hidden)}

    dyn = {0: "batch", 1: "seq"}
    axes = {"x": dyn, "y": dyn}
    return SwiGLU().eval(), inputs, ["y"], axes, ["fuse_split_gates (SwiGLU, chunk)"]


def lstm_hand():
    import torch

    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ih = torch.nn.Linear(S.cell_in, 4 * S.cell_hidden)
            self.hh = torch.nn.Linear(S.cell_hidden, 4 * S.cell_hidden)

        def forward(self, x, h, c):
            i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, 1)
            c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c2), c2

    def inputs(b, _s):
        x, h = torch.randn(b, S.cell_in), torch.randn(b, S.cell_hidden)
        return {"x": x, "h": h, "c": torch.randn(b, S.cell_hidden)}

    dyn = {0: "batch"}
    axes = {"x": dyn, "h": dyn, "c": dyn, "h_out": dyn, "c_out": dyn}
    return Cell().eval(), inputs, ["h_out", "c_out"], axes, ["fuse_split_gates (chunk(4))"]


def _recurrent(kind: str):
    import torch

    hidden = S.cell_hidden // 2
    layer = getattr(torch.nn, kind)(S.cell_in, hidden, num_layers=2, batch_first=True).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            y, state = self.layer(x)
            return (y, *state) if isinstance(state, tuple) else (y, state)

    def inputs(b, s):
        return {"x": torch.randn(b, s, S.cell_in)}

    states = ["h_n", "c_n"] if kind == "LSTM" else ["h_n"]
    axes = {"x": {0: "batch", 1: "seq"}, "y": {0: "batch", 1: "seq"}}
    axes.update({name: {1: "batch"} for name in states})
    patterns = [f"onnx_rnn ({kind}, dynamic sequence: one loop kernel per layer)"]
    return Wrap(), inputs, ["y", *states], axes, patterns


def lstm():
    return _recurrent("LSTM")


def gru():
    return _recurrent("GRU")


MODELS = {
    "xlnet": xlnet,
    "bert_mlm": bert_mlm,
    "distilbert": distilbert,
    "gpt2": gpt2,
    "gpt2_labels": gpt2_labels,
    "llama": llama,
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "swiglu_chunk": swiglu_chunk,
    "lstm_hand": lstm_hand,
    "lstm": lstm,
    "gru": gru,
}
MODELS.update(
    {"opt": opt, "qwen2": qwen2, "phi3": phi3, "mistral": mistral}
    | {"gpt_neox": gpt_neox, "falcon": falcon}
    | {"mixtral": mixtral, "qwen2_moe": qwen2_moe}
)


# --- issue #27, encoders and encoder-decoders (branch arch-enc) ---


def _hidden_only(model, names, **extra):
    """A transformers model as (names...) -> last hidden state (its first output). The
    forward names its arguments (torch.export matches ``dynamic_shapes`` by name)."""
    import torch

    def first(self, *args):
        kwargs = dict(zip(names, args, strict=True))
        return self.m(**kwargs, **extra, return_dict=False)[0]

    params = ", ".join(names)
    scope = {"first": first}
    exec(f"def forward(self, {params}):\n    return first(self, {params})\n", scope)  # noqa: S102
    wrap = type("Wrap", (torch.nn.Module,), {"forward": scope["forward"]})()
    wrap.m = model
    return wrap


def _padded_mask(b, s):
    import torch

    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, -2:] = 0
    return mask


def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2Model

    cfg = DebertaV2Config(
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        max_position_embeddings=S.max_pos,
        relative_attention=True,
        position_buckets=16,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    names = ["input_ids", "attention_mask"]
    model = _hidden_only(DebertaV2Model(cfg).eval(), names)

    def inputs(b, s):
        return {"input_ids": _tokens(b, s), "attention_mask": _padded_mask(b, s)}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "hidden": dyn}
    return model, inputs, ["hidden"], axes, ["relative positions (Tile / repeat of shapes)"]


def clip_text():
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(
        vocab_size=S.vocab,
        hidden_size=S.hidden,
        intermediate_size=S.inner,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        max_position_embeddings=77,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        attn_implementation="eager",
    )
    names = ["input_ids", "attention_mask"]
    model = _hidden_only(CLIPTextModel(cfg).eval(), names)

    def inputs(b, s):
        return {"input_ids": _tokens(b, s), "attention_mask": _padded_mask(b, s)}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "hidden": dyn}
    return model, inputs, ["hidden"], axes, ["position ids gather, causal mask (Concat of shapes)"]


def t5():
    """T5 encoder-decoder, one full decoder pass (no cache), gated GELU feed-forwards."""
    import torch
    from transformers import T5Config, T5Model

    cfg = T5Config(
        vocab_size=S.vocab,
        d_model=S.hidden,
        d_kv=S.hidden // S.heads,
        d_ff=S.inner,
        num_layers=1,  # one encoder and one decoder block: the biggest family otherwise
        num_decoder_layers=1,
        num_heads=S.heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        use_cache=False,
        attn_implementation="eager",
    )
    names = ["input_ids", "attention_mask", "decoder_input_ids"]
    model = _hidden_only(T5Model(cfg).eval(), names, use_cache=False)

    def inputs(b, s):
        ids = _tokens(b, s)
        return {
            "input_ids": ids,
            "attention_mask": _padded_mask(b, s),
            "decoder_input_ids": torch.randint(0, S.vocab, (b, s - 2), dtype=torch.int64),
        }

    dyn = {0: "batch", 1: "seq"}
    dec = {0: "batch", 1: "dec_seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "decoder_input_ids": dec, "hidden": dec}
    return model, inputs, ["hidden"], axes, ["fuse_split_gates (gated gelu_new, wi_0 / wi_1)"]


def vit():
    import torch
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        hidden_size=S.hidden,
        num_hidden_layers=S.layers,
        num_attention_heads=S.heads,
        intermediate_size=S.inner,
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = _hidden_only(ViTModel(cfg, add_pooling_layer=False).eval(), ["pixel_values"])

    def inputs(b, _s):
        return {"pixel_values": torch.randn(b, 3, 32, 32)}

    axes = {"pixel_values": {0: "batch"}, "hidden": {0: "batch"}}
    return model, inputs, ["hidden"], axes, ["patch embedding conv, encoder (batch only)"]


def whisper_encoder():
    import torch
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(
        vocab_size=S.vocab,
        d_model=S.hidden,
        encoder_layers=S.layers,
        encoder_attention_heads=S.heads,
        encoder_ffn_dim=S.inner,
        decoder_layers=1,
        decoder_attention_heads=S.heads,
        decoder_ffn_dim=S.inner,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        attn_implementation="eager",
    )
    model = _hidden_only(WhisperEncoder(cfg).eval(), ["input_features"])

    def inputs(b, _s):  # the encoder takes exactly 2 * max_source_positions frames
        return {"input_features": torch.randn(b, 8, 32)}

    axes = {"input_features": {0: "batch"}, "hidden": {0: "batch"}}
    return model, inputs, ["hidden"], axes, ["conv front end, encoder (batch only)"]


def distilbert_labels():
    from transformers import DistilBertForMaskedLM

    cfg = _distilbert_config()
    model = _masked_lm(DistilBertForMaskedLM(cfg).eval())

    def inputs(b, s):
        labels = _tokens(b, s)
        labels[:, ::3] = -100  # unmasked positions: ignore_index
        return {"input_ids": _tokens(b, s), "attention_mask": _padded_mask(b, s), "labels": labels}

    dyn = {0: "batch", 1: "seq"}
    axes = {"input_ids": dyn, "attention_mask": dyn, "labels": dyn, "logits": dyn}
    return model, inputs, ["loss", "logits"], axes, ["fuse_cross_entropy (MLM loss)"]


MODELS.update(
    {
        "deberta_v2": deberta_v2,
        "clip_text": clip_text,
        "t5": t5,
        "vit": vit,
        "whisper_encoder": whisper_encoder,
        "distilbert_labels": distilbert_labels,
    }
)


# Bench scale only: models at their real vocabulary (awkward sizes, issue #24): GPT-2's 50257
# and BERT's 30522 columns in the LM head, the log-softmax and the loss.
REAL_VOCAB = {"gpt2_50257": ("gpt2", 50257), "bert_mlm_30522": ("bert_mlm", 30522)}


def _export(module, args, names, outputs, axes, path: Path, dynamo: bool) -> None:
    import torch

    opset = OPSET["dynamo" if dynamo else "torchscript"]
    kwargs = {"input_names": names, "output_names": outputs, "opset_version": opset}
    if dynamo:
        from torch.export import Dim

        dims: dict[str, Dim] = {}
        shapes = {}
        for name in names:
            spec = {
                a: dims.setdefault(n, Dim(n, min=1, max=S.max_pos)) for a, n in axes[name].items()
            }
            shapes[name] = spec or None
        kwargs.update(dynamo=True, dynamic_shapes=shapes, optimize=True, external_data=False)
    else:
        kwargs.update(dynamo=False, dynamic_axes=axes, do_constant_folding=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(args), str(path), **kwargs)


def export_one(name: str, exporter: str) -> dict:
    global S
    if name in REAL_VOCAB:
        base, vocab = REAL_VOCAB[name]
        saved, S = S, dataclasses.replace(S, vocab=vocab)
        try:
            return _export_one(name, base, exporter)
        finally:
            S = saved
    return _export_one(name, name, exporter)


def _export_one(name: str, builder: str, exporter: str) -> dict:
    import onnx
    import onnxruntime as ort
    import torch

    _seed()
    module, make_inputs, outputs, axes, patterns = MODELS[builder]()
    example = make_inputs(*S.export_shape)
    names = list(example)
    stem = f"{name}_{exporter}"
    path = S.out / f"{stem}.onnx"
    _export(module, example.values(), names, outputs, axes, path, exporter == "dynamo")
    model = onnx.load(str(path))
    if any(n.metadata_props or n.doc_string for n in model.graph.node):
        # the exporters' per-node stack traces and source paths: over half of a dynamo file
        for node in model.graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
        onnx.save(model, str(path))
    onnx.checker.check_model(model)
    check = make_inputs(*S.check_shape)
    feeds = {k: v.numpy() for k, v in check.items()}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    with torch.no_grad():
        want = module(*check.values())
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)
    graph_outputs = [o.name for o in model.graph.output]
    np.savez_compressed(
        S.out / f"{stem}.npz",
        **{f"in:{k}": v for k, v in feeds.items()},
        **{f"out:{k}": v for k, v in zip(graph_outputs, got, strict=True)},
    )
    ops = sorted({n.op_type for n in model.graph.node})
    return {
        "file": path.name,
        "exporter": exporter,
        "inputs": [[k, list(v.shape)] for k, v in feeds.items()],  # graph order
        "outputs": graph_outputs,
        "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in axes.items()},
        "patterns": patterns,
        "ops": ops,
        "bytes": path.stat().st_size,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "models",
        nargs="*",
        help=f"default: all ({', '.join(MODELS)}; at bench scale also {', '.join(REAL_VOCAB)})",
    )
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument(
        "--scale",
        default="test",
        choices=list(SCALES),
        help="test: tiny configs to tests/corpus (checked in); bench: larger ones to bench/models",
    )
    args = parser.parse_args(argv)
    global S
    S = SCALES[args.scale]
    OUT = S.out
    if not args.models:
        args.models = list(MODELS) + (list(REAL_VOCAB) if args.scale == "bench" else [])
    import logging

    import torch
    import transformers

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    OUT.mkdir(parents=True, exist_ok=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest["_versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in args.models:
        for exporter in args.exporters.split(","):
            key = f"{name}_{exporter}"
            try:
                manifest[key] = export_one(name, exporter)
                print(f"{key}: {manifest[key]['bytes'] / 1024:.0f} KiB", flush=True)
            except Exception as err:  # noqa: BLE001 - record why and go on
                line = str(err).strip().splitlines()[0][:300] if str(err).strip() else repr(err)
                manifest[key] = {"skipped": f"{type(err).__name__}: {line}"}
                for stale in (OUT / f"{key}.onnx", OUT / f"{key}.npz"):
                    stale.unlink(missing_ok=True)
                print(f"{key}: skipped: {manifest[key]['skipped']}", flush=True)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
