"""One declaration per op, from which both of its paths are made.

An op is declared once: its launcher (plain tensors in, new tensors out), its fake (the outputs'
shapes and dtypes), what it saves for backward (`setup_context`) and its backward. From that
declaration come the `torch.library` custom op with its fake and autograd, used while
torch.compile traces and for tensor subclasses, and an eager `torch.autograd.Function` over the
same launcher, setup and backward for plain tensors, meta tensors included (the custom op's
dispatch costs host time on every call, which small kernels cannot hide; on meta tensors the
launchers allocate what they allocate on the GPU and launch nothing).
Backward kernels are declared the same way (`launcher`): one function, dispatched through its
custom op or called directly by the same rule, so the two paths launch the same kernels with the
same arguments.

The one difference the two paths cannot share: a custom op's outputs may not alias each other,
so an op with `fan_out` hands its output to several consumers as views of one tensor only on the
eager path (each consumer's gradient then reaches the backward on its own); while tracing the
same tensor is returned once per consumer and autograd sums their gradients first."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch


def use_custom_op(t: torch.Tensor) -> bool:
    """Whether a call on `t` goes through the torch.library custom op: while torch.compile
    traces, and for tensor subclasses (fake tensors, ...), which need the registered fake.
    Plain tensors call the launcher directly: on meta tensors it allocates its outputs and
    scratch as on the GPU and skips the launch (memplan.kernels._launch.on_meta), which is what
    the traced step (memplan/traced) records."""
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def launcher(
    name: str, *, fake: Callable[..., Any], mutates_args: Sequence[str] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the launcher `fn` (type-annotated, positional arguments, first one a tensor)
    registered as the custom op memplan::`name` with `fake`; calling the result dispatches
    through the custom op where use_custom_op(first argument), else calls `fn` itself (and bumps
    the version counters of the arguments it mutates, as the custom op does)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        custom = torch.library.custom_op(f"memplan::{name}", fn, mutates_args=tuple(mutates_args))
        custom.register_fake(fake)

        parameters = inspect.signature(fn).parameters
        mutated = [i for i, param in enumerate(parameters) if param in mutates_args]

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            if use_custom_op(args[0]):
                return custom(*args)
            result = fn(*args)
            for i in mutated:  # as the custom op does: autograd then refuses stale saved values
                torch.autograd.graph.increment_version(args[i])
            return result

        call.custom_op = custom
        call.launch = fn
        return call

    return register


class Op:
    """A differentiable op made from one declaration.

    forward(*inputs) -> outputs: the launcher; `fake` gives the outputs' metadata;
    setup_context(ctx, inputs, output) saves what backward needs (torch.library's parameter
    names); backward(ctx, *grads) returns one gradient (or None) per input, grads being the
    outputs' gradients followed, on the eager path, by the gradients of the extra views of output
    `fan_out` (see the module docstring). With `mutates_args` the custom op mutates those
    inputs; torch.library gives mutating ops no autograd, so both paths then run the
    autograd.Function, whose forward calls the launcher through its custom op while tracing."""

    def __init__(
        self,
        name: str,
        forward: Callable[..., Any],
        *,
        fake: Callable[..., Any],
        setup_context: Callable[[Any, tuple, Any], None],
        backward: Callable[..., tuple],
        fan_out: int | None = None,
        mutates_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.fan_out = fan_out
        self.forward = launcher(name, fake=fake, mutates_args=mutates_args)(forward)
        self.custom_op = self.forward.custom_op
        self.functional = not mutates_args
        if self.functional:
            self.custom_op.register_autograd(backward, setup_context=setup_context)
        run = self.forward if mutates_args else forward

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *inputs_and_consumers: Any) -> Any:
                *inputs, consumers = inputs_and_consumers
                outputs = run(*inputs)
                setup_context(ctx, tuple(inputs), outputs)
                if consumers == 1:
                    return outputs
                shared = outputs[fan_out]
                return (*outputs, *(shared.view_as(shared) for _ in range(consumers - 1)))

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> tuple:
                return (*backward(ctx, *grads), None)

        Function.__name__ = Function.__qualname__ = f"{name}_function"
        self.function = Function

    def __call__(self, *inputs: Any) -> Any:
        """The op's outputs, through the custom op or the autograd.Function (use_custom_op)."""
        if self.functional and use_custom_op(inputs[0]):
            return self.custom_op(*inputs)
        return self.function.apply(*inputs, 1)

    def fanned_out(self, *inputs: Any, consumers: int) -> tuple[tuple, tuple[torch.Tensor, ...]]:
        """(outputs, output `fan_out` once per consumer): views of one tensor on the eager path,
        the same tensor repeated while tracing (see the module docstring)."""
        if consumers == 1 or use_custom_op(inputs[0]):
            outputs = self(*inputs)
            return outputs, (outputs[self.fan_out],) * consumers
        everything = self.function.apply(*inputs, consumers)
        n_outputs = len(everything) - (consumers - 1)
        return everything[:n_outputs], (everything[self.fan_out], *everything[n_outputs:])
