"""Forward programs of the HF RMSNorm and eager attention: their temporaries in the order the
modules make them."""

from memplan.estimators.norm_programs import TEMPORARIES, norm_program
from memplan.estimators.scores_programs import math_program, scores_program


def test_bf16_norm_frozen_weight_keeps_its_cast_until_the_output():
    steps = norm_program(32, 2, input_kept=False, trained=False)
    assert steps == [
        ("saved", 1),
        ("alloc", "norm.pow", 32),
        ("free", "norm.pow"),
        ("alloc", "norm.normed", 32),
        ("unsaved",),
        ("saved",),
        ("alloc", "norm.cast", 16),
    ]
    assert TEMPORARIES == [("free", "norm.cast"), ("free", "norm.normed")]


def test_fp32_norm_trained_weight_saves_the_product_itself():
    steps = norm_program(32, 4, input_kept=True, trained=True)
    assert steps[:3] == [("alloc", "norm.pow", 32), ("free", "norm.pow"), ("saved",)]
    assert ("alloc", "norm.normed", 0) in steps


def test_bf16_eager_scores_upcast_for_softmax():
    steps = scores_program(256, 2)
    assert steps == [
        ("alloc", "attn.product", 128),
        ("alloc", "attn.scaled", 128),
        ("free", "attn.product"),
        ("alloc", "attn.masked", 128),
        ("free", "attn.scaled"),
        ("alloc", "attn.upcast", 256),
        ("saved",),
        ("free", "attn.upcast"),
    ]


def test_sdpa_math_path_holds_a_bool_mask_beside_the_probabilities():
    steps = math_program(96)
    assert steps == [
        ("alloc", "attn.product", 96),
        ("saved",),
        ("alloc", "attn.bool", 24),
        ("free", "attn.bool"),
        ("free", "attn.product"),
    ]
