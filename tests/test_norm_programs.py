"""The HF RMSNorm's forward program: its temporaries in the order LlamaRMSNorm makes them."""

from memplan.estimators.norm_programs import TEMPORARIES, norm_program


def test_bf16_norm_frozen_weight_keeps_its_cast_until_the_output():
    steps = norm_program(32, 2, input_kept=False, trained=False)
    assert steps == [
        ("saved", 1),
        ("alloc", "norm.pow", 32),
        ("free", "norm.pow"),
        ("alloc", "norm.normed", 32),
        ("saved",),
        ("alloc", "norm.cast", 16),
    ]
    assert TEMPORARIES == [("free", "norm.cast"), ("free", "norm.normed")]


def test_fp32_norm_trained_weight_saves_the_product_itself():
    steps = norm_program(32, 4, input_kept=True, trained=True)
    assert steps[:3] == [("alloc", "norm.pow", 32), ("free", "norm.pow"), ("saved",)]
    assert ("alloc", "norm.normed", 0) in steps
