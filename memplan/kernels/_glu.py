"""What SwiGLU and GeGLU share: launchers, custom ops, autograd and the gated-MLP module, around
each op's own pair of Triton kernels (swiglu.py, geglu.py), which differ only in the activation.

Both kernels take (gate, up, out) rows with their row strides for the forward, and (d_out, gate,
up, d_gate, d_up, product) for the backward, over (ROWS x BLOCK) tiles numbered along memory
(`tile_of`). Only gate and up are saved; backward recomputes the activation. With
`in_place_backward` the two gradients overwrite the saved gate and up buffers (as Liger-Kernel
does), so backward allocates nothing; that is wrong if gate or up is read again after this
backward (retain_graph, or a shared tensor).

Given the `down` projection, the op computes down(act(gate) * up) and does not keep the product
for down's weight gradient: backward recomputes it from the saved gate and up (one elementwise
pass) instead of holding rows x intermediate values per layer from forward to backward. The
backward kernel that reads d_product writes the product over it (WRITE_PRODUCT), so the
recompute costs one more write, not a pass of its own, and the transient is what nn.Linear's
backward allocates anyway: one rows x intermediate buffer."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from memplan.errors import UsageError
from memplan.kernels._utils import (
    as_rows,
    cdiv,
    check_floating,
    elementwise_launch_config,
    empty_like_rows,
    first_order_only,
    may_write_over,
    memory_overlaps,
    on_device,
    use_custom_op,
)


@triton.jit
def tile_of(pid, n_col_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(rows[:, None], cols[None, :]) of tile `pid` on a 1-d grid: the column blocks of a row
    group are consecutive programs, so neighbouring programs touch neighbouring memory (a 2-d
    grid with rows on axis 0 walks down a column block instead). Row indices are int64.
    n_col_blocks comes from the host: Triton specializes an integer argument equal to 1, so for
    rows of one block the division below folds away. Computed in the kernel, it cost 4096 x 1024
    SwiGLU 13.5 against 11.3 us forward+backward on an H200 (benchmarks/probe_glu_small.py)."""
    pid = pid.to(tl.int64)
    rows = (pid // n_col_blocks) * ROWS + tl.arange(0, ROWS)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return rows[:, None], cols[None, :]


@triton.jit
def load_tile(ptr, row_stride, rows, cols, mask, EVICTION: tl.constexpr):
    """A (ROWS x BLOCK) tile of a row-strided tensor, in fp32, loaded with the eviction policy
    EVICTION (see the module's EVICTION)."""
    value = tl.load(ptr + rows * row_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    return value.to(tl.float32)


@triton.jit
def store_tile(ptr, row_stride, rows, cols, value, mask):
    """`value` into a (ROWS x BLOCK) tile of a row-strided tensor, in its dtype."""
    tl.store(ptr + rows * row_stride + cols, value.to(ptr.dtype.element_ty), mask=mask)


# The eviction policy ("" for the default) of the loads of each kernel: the forward's of gate and
# up, the backward's of d_out and of gate and up. Triton lowers "evict_last" to L1::evict_last
# with an L2::evict_last cache policy; the lines of the outputs, stored with the default policy,
# then leave the L2 first. Measured on an H200 (benchmarks/probe_glu_eviction.py), evict_last on
# every load against the default:
# - forward+backward in place (bench_kernels.py's judged row), 16384 x 8192 to 65536 x 4096:
#   0.990-0.995 x torch.compile's time, against 1.001-1.007;
# - the backward alone after down_proj's d_product GEMM, as in training: 8192 x 14336 SwiGLU
#   326.5 against 335.1 us, 8192 x 24576 GeGLU 559.7 against 576.1 us;
# - Nsight Compute: the same DRAM bytes in that backward and in the GEMM after it (1.05-1.06 GB
#   read, 1.18-1.19 ms): the sticky lines do not cost the next kernel its L2.
EVICTION = {
    "forward": "evict_last",
    "backward_dout": "evict_last",
    "backward_gate_up": "evict_last",
}


def _grid(n_rows: int, rows: int, n_col_blocks: int) -> tuple[int]:
    return (cdiv(n_rows, rows) * n_col_blocks,)


class GluOp:
    """One gated activation: `forward(gate, up)`, `backward(dout, gate, up)` and the fused,
    differentiable `__call__(gate, up, in_place_backward=...)`, registered as memplan::{name}."""

    def __init__(self, name: str, forward_kernel, backward_kernel, **constants) -> None:
        self.name = name
        self.forward_kernel = forward_kernel
        self.backward_kernel = backward_kernel
        self.constants = constants  # extra constexpr arguments of both kernels
        self._register()

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g2, u2 = as_rows(gate), as_rows(up)
        out = empty_like_rows(gate)
        n_rows, n_cols = g2.shape
        if out.numel() == 0:  # no rows, or rows of 0 elements
            return out
        rows, block, num_warps = elementwise_launch_config(n_cols)
        n_col_blocks = cdiv(n_cols, block)
        with on_device(gate):
            self.forward_kernel[_grid(n_rows, rows, n_col_blocks)](
                g2,
                u2,
                out,
                g2.stride(0),
                u2.stride(0),
                n_cols,
                n_rows,
                n_cols,
                n_col_blocks,
                ROWS=rows,
                BLOCK=block,
                EVICTION=EVICTION["forward"],
                num_warps=num_warps,
                **self.constants,
            )
        return out

    def backward(
        self,
        dout: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        dgate: torch.Tensor | None = None,
        dup: torch.Tensor | None = None,
        product: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d_gate, d_up), written into `dgate`/`dup` when given; with `product`, the forward's
        output act(gate) * up is written there too. Any of the three may be one of the inputs
        (dgate=gate, dup=up, product=dout): each element is read before it is written, by the
        same program."""
        do2, g2, u2 = as_rows(dout), as_rows(gate), as_rows(up)
        if dgate is None:
            dgate = empty_like_rows(gate)
        if dup is None:
            dup = empty_like_rows(up)
        dg2 = g2 if dgate is gate else as_rows(dgate)
        du2 = u2 if dup is up else as_rows(dup)
        n_rows, n_cols = g2.shape
        p2 = du2 if product is None else product.view(n_rows, n_cols)
        if dgate.numel() == 0:
            return dgate, dup
        rows, block, num_warps = elementwise_launch_config(n_cols)
        n_col_blocks = cdiv(n_cols, block)
        with on_device(gate):
            self.backward_kernel[_grid(n_rows, rows, n_col_blocks)](
                do2,
                g2,
                u2,
                dg2,
                du2,
                p2,
                do2.stride(0),
                g2.stride(0),
                u2.stride(0),
                dg2.stride(0),
                du2.stride(0),
                p2.stride(0),
                n_rows,
                n_cols,
                n_col_blocks,
                ROWS=rows,
                BLOCK=block,
                WRITE_PRODUCT=product is not None,
                DOUT_EVICTION=EVICTION["backward_dout"],
                GATE_UP_EVICTION=EVICTION["backward_gate_up"],
                num_warps=num_warps,
                **self.constants,
            )
        return dgate, dup

    def _register(self) -> None:
        """The torch.library custom ops (torch.compile, fake and meta tensors) and the eager
        autograd.Function (plain tensors: see memplan.kernels._utils.use_custom_op)."""
        name, forward, backward = self.name, self.forward, self.backward

        def op(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool) -> torch.Tensor:
            return forward(gate, up)

        def backward_op(
            dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return backward(dout, gate, up)

        custom = torch.library.custom_op(f"memplan::{name}", op, mutates_args=())
        custom.register_fake(lambda gate, up, in_place_backward: gate.new_empty(gate.shape))
        custom_backward = torch.library.custom_op(
            f"memplan::{name}_backward", backward_op, mutates_args=()
        )
        custom_backward.register_fake(
            lambda dout, gate, up: (gate.new_empty(gate.shape), up.new_empty(up.shape))
        )

        @first_order_only
        def gradients(ctx, dout):
            """Gradients of (gate, up, in_place_backward); out of place under the custom op."""
            gate, up = ctx.saved_tensors
            if use_custom_op(dout):
                dgate, dup = custom_backward(dout, gate, up)
            elif _in_place_allowed(ctx, gate, up):
                backward(dout, gate, up, dgate=gate, dup=up)
                _mark_overwritten(gate, up)
                dgate, dup = gate.view(gate.shape), up.view(up.shape)
            else:
                dgate, dup = backward(dout, gate, up)
            return dgate, dup, None

        def setup_context(ctx, inputs, output):
            gate, up, in_place_backward = inputs
            ctx.save_for_backward(gate, up)
            ctx.in_place_backward = in_place_backward

        custom.register_autograd(gradients, setup_context=setup_context)

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, gate, up, in_place_backward):
                setup_context(ctx, (gate, up, in_place_backward), None)
                return forward(gate, up)

            backward = staticmethod(gradients)

        class DownFunction(torch.autograd.Function):
            """down(act(gate) * up) saving gate and up, not the product."""

            @staticmethod
            def forward(ctx, gate, up, weight, bias, in_place_backward):
                ctx.save_for_backward(gate, up, weight)
                ctx.in_place_backward = in_place_backward
                ctx.has_bias = bias is not None
                return F.linear(forward(gate, up), weight, bias)

            @staticmethod
            @first_order_only
            def backward(ctx, d_out):
                gate, up, weight = ctx.saved_tensors
                d_weight = d_bias = None
                d_rows = d_out.reshape(-1, d_out.shape[-1])
                if ctx.needs_input_grad[3]:
                    d_bias = d_rows.sum(0)
                buffer = torch.matmul(d_out, weight)  # d_product, then the product over it
                if _in_place_allowed(ctx, gate, up):
                    backward(buffer, gate, up, dgate=gate, dup=up, product=buffer)
                    _mark_overwritten(gate, up)
                    d_gate, d_up = gate.view(gate.shape), up.view(up.shape)
                else:
                    d_gate, d_up = backward(buffer, gate, up, product=buffer)
                if ctx.needs_input_grad[2]:
                    d_weight = d_rows.t().mm(buffer.view(-1, buffer.shape[-1]))
                return d_gate, d_up, d_weight, d_bias, None

        self._custom, self._function, self._down_function = custom, Function, DownFunction

    def __call__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        *,
        in_place_backward: bool = False,
        down: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        check_floating(self.name, gate, up)
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise UsageError(
                f"{self.name} needs gate and up of one shape and dtype, got "
                f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}."
            )
        if down is not None and recompute_product(down, gate):
            return self._down_function.apply(gate, up, down.weight, down.bias, in_place_backward)
        if use_custom_op(gate):
            product = self._custom(gate, up, in_place_backward)
        else:
            product = self._function.apply(gate, up, in_place_backward)
        return product if down is None else down(product)


def _in_place_allowed(ctx, gate: torch.Tensor, up: torch.Tensor) -> bool:
    """The gradients may go over the saved gate and up: the caller allowed it, both gradients
    are wanted, gate and up are contiguous, do not share elements (swiglu(y, y)) and are not
    leaves (or views of leaves) that require grad, whose values would become their gradients."""
    return (
        ctx.in_place_backward
        and ctx.needs_input_grad[0]
        and ctx.needs_input_grad[1]
        and gate.is_contiguous()
        and up.is_contiguous()
        and not memory_overlaps(gate, up)
        and may_write_over(gate)
        and may_write_over(up)
    )


def _mark_overwritten(*tensors: torch.Tensor) -> None:
    """Bump the version counters of tensors a kernel wrote: a second backward through the same
    graph (retain_graph) then raises instead of reading gradients as saved inputs."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


def recompute_product(down: torch.nn.Module, gate: torch.Tensor) -> bool:
    """Whether `down` can run inside the op, with the product recomputed in backward: a plain
    nn.Linear without hooks (PEFT adapters, FSDP's unshard hooks and the like keep their own
    call) whose weight matches gate's dtype, on eager tensors (torch.compile traces the custom
    ops) and outside autocast (which would cast inside nn.Linear)."""
    return (
        type(down) is torch.nn.Linear
        and not (down._forward_hooks or down._forward_pre_hooks)
        and not (torch.nn.modules.module._global_forward_hooks)
        and not (torch.nn.modules.module._global_forward_pre_hooks)
        and down.weight.dtype == gate.dtype
        and not use_custom_op(gate)
        and not torch.is_autocast_enabled(gate.device.type)
    )


class GatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with the gated product fused by `glu`."""

    glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a staticmethod in subclasses

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, **kwargs
    ) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **kwargs)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, **kwargs)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.glu(self.gate_proj(x), self.up_proj(x), down=self.down_proj)
