"""ONNX's own node tests for the ops whose stock converters gave wrong numbers
(``tvm_fusion/frontend/onnx_fixes.py``, the runtime-shape ``Expand`` of ``onnx_ops``, and a
``Shape`` as a graph output, ``load.tensor_outputs``), and the CI slice of the conformance
suite (``scripts/onnx_conformance.py``): the ops our importer overrides and our passes rewrite.
Each case passes against ONNX's reference outputs, or is refused in one line; none is wrong.
Run by ``onnx_node_cases``."""

from __future__ import annotations

import pytest
from onnx_node_cases import names_of, run_case

# ONNX generator modules whose every case is run here
FAMILIES = [
    "expand",
    "spacetodepth",
    "depthtospace",
    "convtranspose",
    "isinf",
    "mod",
    "layernormalization",
    "shape",
    "batch_normalization",
    "splittosequence",
    "roialign",
    "nonmaxsuppression",
    # the CI slice: what the importer overrides (onnx_ops) and the passes rewrite
    "reshape",
    "constantofshape",
    "slice",
    "concat",
    "tile",
    "clip",
    "gemm",
    "matmul",
    "softmax",
    "gather",
    "gatherelements",
    "gathernd",
    "split",
    "transpose",
    "squeeze",
    "unsqueeze",
    "where",
    "erf",
    "sigmoid",
    "tanh",
    "lstm",
    "gru",
]

# single cases of larger families: Cast from or to float8 / int4 (wrong numbers, refused)
CASES = [
    "test_cast_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_FLOAT8E5M2_to_FLOAT",
    "test_cast_FLOAT_to_INT4",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_FLOAT_to_FLOAT16",
    "test_cast_FLOAT_to_BFLOAT16",
    # unnamed nodes (a function-expanded op): the importer's refusal of a shape operand named
    # no node ("Node  cannot handle ShapeExpr inputs"); load_onnx names the nodes first
    "test_layer_normalization_2d_axis_negative_1_expanded",
    "test_layer_normalization_3d_axis_negative_2_epsilon_expanded_ver18",
    # forms stock refuses (onnx_op_gaps.py): MaxPool's Indices, integer / mixed-dtype Pow,
    # CumSum with a run-time axis
    "test_maxpool_with_argmax_2d_precomputed_pads",
    "test_maxpool_with_argmax_2d_precomputed_strides",
    *(f"test_pow_types_{t}" for t in ("float32_int32", "float32_int64", "int32_float32")),
    *(f"test_pow_types_{t}" for t in ("int64_float32", "int32_int32", "int64_int64")),
    "test_pow_types_float32_uint32",  # ONNX Runtime has no kernel for these two
    "test_pow_types_float32_uint64",
    *(f"test_cumsum_{t}" for t in ("1d", "1d_exclusive", "1d_int32_exclusive", "1d_reverse")),
    *(f"test_cumsum_{t}" for t in ("1d_reverse_exclusive", "2d_axis_0", "2d_axis_1")),
    *(f"test_cumsum_{t}" for t in ("2d_int32", "2d_negative_axis")),
    # the function-expanded LayerNormalization from a positive axis: Size(Shape(x)) is the
    # rank, a constant, so the reduced shape folds (onnx_dynamic.Size); axis 0 included
    *(
        f"test_layer_normalization_{d}_axis{a}{e}_expanded{v}"
        for d, axes, e in (("2d", "01", ""), ("3d", "012", "_epsilon"), ("4d", "0123", ""))
        for a in axes
        for v in ("", "_ver18")
    ),
    # Pad with pads / constant_value / axes given at run time (onnx_dynamic.Pad); Split with
    # run-time sizes runs with the split family above
    "test_constant_pad",
    "test_constant_pad_axes",
    "test_constant_pad_negative_axes",
    "test_edge_pad",
    "test_reflect_pad",
    "test_wrap_pad",
    # ONNX Range: its length, a scalar reshaped to (1,), crashed FuseSplitGates' unbind plan
    "test_range_float_type_positive_delta",
    "test_range_int32_type_negative_delta",
    "test_range_float16_type_positive_delta",
    "test_range_bfloat16_type_positive_delta",
    # found by the whole suite (onnx_refusals.py): a shift count out of range (stock: C's
    # shift, -8 << 32 = -8), Dropout's mask (stock: float32) and training mode (ignored)
    "test_bitshift_left_int32_shift_ge_width",
    "test_bitshift_right_int8_negative_shift",
    "test_dropout_default_mask",
    "test_training_dropout_mask",
    # ReduceMax of a row of -inf (stock: -3.4e38), which the expanded Attention compares to
    # -inf to find a row masked in full
    "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded",
    # opset 23's Attention (stock: com.microsoft's converter, "'num_heads'"): our converter
    # (onnx_attention.py: 4-D / 3-D, GQA, masks, causal, a fully masked row) and the function
    # body for the rest (past and present, softcap, qk output, padded keys, fp16)
    *(f"test_attention_4d_{t}" for t in ("attn_mask_bool_4d", "attn_mask_4d_causal")),
    "test_attention_3d_gqa_attn_mask",
    "test_attention_23_boolmask_fullymasked_row_nan_robustness",
    "test_attention_3d_diff_heads_with_past_and_present",
    "test_attention_3d_diff_heads_sizes_softcap",
    "test_attention_24_fullymasked_qk_matmul_output_mode3_zero",
    "test_attention_4d_causal_fp16",
    # ops imported through ONNX's function bodies (onnx_functions.py), Constant's value_*
    # forms (the expanded cases), and onnx_op_gaps' Celu, EyeLike's dtype, LpNormalization,
    # RMSNormalization over every axis, CumProd
    "test_rotary_embedding_interleaved",
    "test_rotary_embedding_no_position_ids_rotary_dim",
    "test_center_crop_pad_crop_and_pad",
    "test_swish",
    "test_elu_expanded_ver18",
    "test_celu_float16",
    "test_eyelike_with_dtype",
    "test_l1normalization_axis_0",
    "test_l2normalization_axis_1",
    "test_rms_normalization_4d_axis0",
    "test_cumprod_2d_negative_axis",
    "test_cumprod_1d_reverse_exclusive",
    "test_reversesequence_batch",
    # Reduce* with axes given at run time (onnx_reduce_axes.py; stock: "Only constant axes")
    "test_reduce_log_sum_exp_empty_set",
    "test_reduce_max_empty_set_bool",
    "test_reduce_sum_empty_axes_input_noop",
    "test_reduce_sum_default_axes_keepdims_random",
    "test_reduce_mean_do_not_keepdims_example",
    "test_reduce_l2_negative_axes_keep_dims_random_expanded",
]

# cases refused in one line (a converter we cannot trust, or a form the importer lacks)
REFUSED = {
    "test_roialign_mode_max",
    "test_split_to_sequence_1",  # split given as a graph input: stock needs a constant
    "test_split_to_sequence_2",
    "test_cast_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_FLOAT8E5M2_to_FLOAT",
    "test_cast_FLOAT_to_INT4",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN",
    "test_training_dropout_mask",  # random output
    *(n for n in names_of("nonmaxsuppression")),
}


def _cases() -> list[str]:
    names = [n for family in FAMILIES for n in names_of(family)]
    # the function-expanded forms test the ops of their bodies, not these converters; a
    # LayerNormalization axis counted from the end takes the same path as from the start
    return CASES + [
        n
        for n in names
        if "_expanded" not in n and not n.startswith("test_layer_normalization_4d_axis_neg")
    ]


@pytest.mark.parametrize("name", _cases())
def test_onnx_node_case(name):
    result = run_case(name)
    assert result == "pass" or result.startswith("refused: "), result
    if name in REFUSED:
        assert result.startswith("refused: "), result
        assert "\n" not in result
    else:
        assert result == "pass"


def test_operands_as_initializers(monkeypatch):
    """``--operands-as-initializers`` (the cases' inputs after the first held as initializers,
    as real models hold them): constant-operand paths the suite's run-time inputs hide (a
    Resize by 0.6 of 4 pixels: stock's numbers were wrong, now refused; opset 10's TopK); a case
    with one input is skipped."""
    import onnx_node_cases as nc

    monkeypatch.setenv(nc.CONSTANTS_ENV, "1")
    assert run_case("test_top_k") == "pass"
    assert run_case("test_reduce_sum_keepdims_example") == "pass"
    resize = run_case("test_resize_downsample_scales_linear")
    assert resize.startswith("refused: load:") and "Resize node" in resize, resize
    assert run_case("test_abs").startswith("skipped: no input after the first")
