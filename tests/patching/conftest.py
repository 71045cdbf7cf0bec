"""Fixtures of the patching tests; the tiny models are built by tiny_models.py."""

from __future__ import annotations

import pytest

from .tiny_models import FAMILIES

# The families every default run covers: separate and fused projections (phi3), SwiGLU and
# GeGLU, softcaps, sliding windows and sandwich norms (gemma2). The rest run under `-m slow`.
DEFAULT_FAMILIES = ("llama", "gemma2", "phi3")


@pytest.fixture(
    params=[
        f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES
    ]
)
def family(request) -> str:
    return request.param
