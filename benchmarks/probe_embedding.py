"""Probe: the embedding weight gradient, torch's dense backward against memplan's
(memplan.kernels.embedding), at the bench_e2e cases' shapes (8 x 2048 random ids into a 128256
vocabulary), GPU time from CUDA graphs (triton.testing.do_bench_cudagraph, median), and the
largest difference from an fp32 index_add reference. Also one id repeated for every token, the
kernel's worst case (one program per column block sums every row).

    python benchmarks/probe_embedding.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memplan.kernels.embedding import (  # noqa: E402
    embedding_backward,
    reference_embedding_backward,
)

VOCAB, TOKENS = 128256, 8 * 2048


def torch_backward(ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.embedding_dense_backward(grad, ids, VOCAB, -1, False)


def main() -> None:
    print("| ids | width | torch us | memplan us | torch / memplan | max abs diff vs fp32 ref |")
    print("|---|---:|---:|---:|---:|---|")
    for label in ("random", "one id"):
        for width in (2048, 4096):
            torch.manual_seed(0)
            ids = torch.randint(0, VOCAB, (8, 2048), device="cuda")
            if label == "one id":
                ids.fill_(7)
            grad = torch.randn(8, 2048, width, device="cuda", dtype=torch.bfloat16)
            t_torch = 1e3 * do_bench_cudagraph(lambda ids=ids, grad=grad: torch_backward(ids, grad))
            t_mp = 1e3 * do_bench_cudagraph(
                lambda ids=ids, grad=grad: embedding_backward(ids, grad, VOCAB, None)
            )
            ref = reference_embedding_backward(ids, grad, VOCAB, None).float()
            diff_mp = (embedding_backward(ids, grad, VOCAB, None).float() - ref).abs().max()
            diff_torch = (torch_backward(ids, grad).float() - ref).abs().max()
            print(
                f"| {label} | {width} | {t_torch:.1f} | {t_mp:.1f} | {t_torch / t_mp:.2f} "
                f"| memplan {diff_mp:.3g}, torch {diff_torch:.3g} |"
            )
    # forward unchanged: the same gather
    weight = torch.randn(VOCAB, 64, device="cuda")
    assert torch.equal(F.embedding(ids, weight), weight[ids])


if __name__ == "__main__":
    main()
