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
from memplan.kernels._op import Op, launcher, use_custom_op
from memplan.kernels._utils import (
    as_rows,
    autocast_dtype,
    cdiv,
    check_floating,
    elementwise_launch_config,
    empty_like_rows,
    first_order_only,
    may_write_over,
    memory_overlaps,
    on_device,
)


@triton.jit
def tile_of(pid, n_col_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(rows[:, None], cols[None, :]) of tile `pid` on a 1-d grid: the column blocks of a row
    group are consecutive programs, so neighbouring programs touch neighbouring memory (a 2-d
    grid with rows on axis 0 walks down a column block instead). Row indices are int64.
    n_col_blocks comes from the host: Triton specializes an integer argument equal to 1, so for
    rows of one block the division below folds away."""
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
# up, the backward's of d_out and of gate and up. "evict_last" keeps the inputs in the L2 while
# the outputs, stored with the default policy, leave it first: the in-place backward then does
# not lose to an out-of-place one (docs/bench_kernels.md, GLU eviction policies).
EVICTION = {
    "forward": "evict_last",
    "backward_dout": "evict_last",
    "backward_gate_up": "evict_last",
}


def _grid(n_rows: int, rows: int, n_col_blocks: int) -> tuple[int]:
    return (cdiv(n_rows, rows) * n_col_blocks,)


class GluOp:
    """One gated activation: the launchers `forward(gate, up)` and `backward(dout, gate, up)`,
    the op made from them (memplan.kernels._op), and the differentiable
    `__call__(gate, up, in_place_backward=..., down=...)`."""

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

    def gradients(
        self,
        ctx,
        dout: torch.Tensor,
        gate: torch.Tensor,
        up: torch.Tensor,
        product: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d_gate, d_up) of the saved gate and up: written over them where _in_place_allowed
        (eager tensors), else new; with `product`, act(gate) * up is written there too."""
        # the custom-op check first: _in_place_allowed reads addresses, which fake tensors lack
        if not use_custom_op(dout) and _in_place_allowed(ctx, gate, up):
            self.backward(dout, gate, up, dgate=gate, dup=up, product=product)
            _mark_overwritten(gate, up)
            return gate.view(gate.shape), up.view(up.shape)
        if product is None:
            return self._backward_launch(dout, gate, up)
        return self.backward(dout, gate, up, product=product)

    def _register(self) -> None:
        """The op (memplan.kernels._op): memplan::{name} and memplan::{name}_backward."""
        forward, backward = self.forward, self.backward

        def op_forward(
            gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool
        ) -> torch.Tensor:
            return forward(gate, up)

        def backward_launch(
            dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return backward(dout, gate, up)

        def backward_fake(dout, gate, up):
            return gate.new_empty(gate.shape), up.new_empty(up.shape)

        def setup_context(ctx, inputs, output):
            """Saves gate and up only: backward recomputes the activation."""
            gate, up, in_place_backward = inputs
            ctx.save_for_backward(gate, up)
            ctx.in_place_backward = in_place_backward

        @first_order_only
        def gradients(ctx, dout):
            """Gradients of (gate, up, in_place_backward)."""
            gate, up = ctx.saved_tensors
            return (*self.gradients(ctx, dout, gate, up), None)

        self._backward_launch = launcher(f"{self.name}_backward", fake=backward_fake)(
            backward_launch
        )
        self.op = Op(
            self.name,
            op_forward,
            fake=lambda gate, up, in_place_backward: gate.new_empty(gate.shape),
            setup_context=setup_context,
            backward=gradients,
        )

    def __call__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        *,
        in_place_backward: bool = False,
        down: torch.nn.Module | None = None,
        autocast: torch.dtype | None = None,
    ) -> torch.Tensor:
        check_floating(self.name, gate, up)
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise UsageError(
                f"{self.name} needs gate and up of one shape and dtype, got "
                f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}."
            )
        if down is not None and recompute_product(down, gate, autocast):
            return _DownProjected.apply(gate, up, down.weight, down.bias, in_place_backward, self)
        product = self.op(gate, up, in_place_backward)
        return product if down is None else down(product)


class _DownProjected(torch.autograd.Function):
    """down(act(gate) * up) saving gate and up, not the product (eager tensors only: see
    recompute_product)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, in_place_backward, glu: GluOp):
        ctx.save_for_backward(gate, up, weight)
        ctx.in_place_backward = in_place_backward
        ctx.glu = glu
        return F.linear(glu.forward(gate, up), weight, bias)

    @staticmethod
    @first_order_only
    def backward(ctx, d_out):
        gate, up, weight = ctx.saved_tensors
        d_weight = d_bias = None
        d_rows = d_out.reshape(-1, d_out.shape[-1])
        if ctx.needs_input_grad[3]:
            d_bias = d_rows.sum(0)
        buffer = torch.matmul(d_out, weight)  # d_product, then the product over it
        d_gate, d_up = ctx.glu.gradients(ctx, buffer, gate, up, product=buffer)
        if ctx.needs_input_grad[2]:
            d_weight = d_rows.t().mm(buffer.view(-1, buffer.shape[-1]))
        return d_gate, d_up, d_weight, d_bias, None, None


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


def recompute_product(
    down: torch.nn.Module, gate: torch.Tensor, autocast: torch.dtype | None = None
) -> bool:
    """Whether `down` can run inside the op, with the product recomputed in backward: a plain
    nn.Linear without hooks (PEFT adapters, FSDP's unshard hooks and the like keep their own
    call) whose weight matches gate's dtype, on eager tensors (torch.compile traces the custom
    ops) and outside autocast (which would cast inside nn.Linear): gate's device's, or
    `autocast`'s dtype where the caller knows it is on (autocast_dtype)."""
    return (
        type(down) is torch.nn.Linear
        and not (down._forward_hooks or down._forward_pre_hooks)
        and not (torch.nn.modules.module._global_forward_hooks)
        and not (torch.nn.modules.module._global_forward_pre_hooks)
        and down.weight.dtype == gate.dtype
        and not use_custom_op(gate)
        and autocast_dtype(gate.device.type, autocast) is None
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
