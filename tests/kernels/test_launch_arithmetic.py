"""The launchers' integer helpers agree with Triton's (which cost ~3 us per call from Python)."""

import triton

from memplan.kernels._utils import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    for n in [*range(-3, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(max(n, 0)), n


def test_cdiv_matches_triton():
    for a in [*range(0, 300), 2**31 + 7, 2**40]:
        for b in (1, 2, 3, 7, 128, 132, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
