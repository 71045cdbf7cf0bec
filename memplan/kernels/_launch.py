"""Kernel launches with less host time: `fast_launch` wraps a @triton.jit kernel so that a call
whose specialization was seen before launches the compiled kernel directly.

Triton's `kernel[grid](*args)` binds and specializes every argument on each call, builds a cache
key and looks the compiled kernel up; at the kernels' small sizes that host time exceeds the GPU
time (docs/bench_kernels.md, host cost per call). The wrapper keys its own cache by exactly what
Triton specializes a call on, for the argument types memplan's kernels take (read from
triton/backends/compiler.py and runtime/jit.py):
- a tensor: its dtype, and whether its address is a multiple of 16 ("D");
- an int: whether it is 1 (then a constexpr), a multiple of 16 ("D"), and its type (i32, i64 or
  u64 by range);
- a float: nothing (fp32);
- the keyword arguments (constexprs and launch options such as num_warps) by value, and the
  current device.
Anything else (bools or other objects as runtime arguments, a kernel signature with a runtime
argument after a constexpr), a launch hook (profilers set one), Triton's interpreter, ROCm, or a
Triton release other than the ones it was tested on take Triton's own path on every call. So does
the first call of each key, which compiles if needed and launches; later calls reuse the compiled
kernel it used. Launches return nothing. `FastKernel.kernel` is the kernel itself, for a launch
through Triton's own path."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import triton

from memplan.kernels._utils import _cuda_devices

try:
    from triton import knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # Triton before 3.4: no knobs module, and no fast path
    knobs = JITFunction = None

# The Triton releases whose launch path the key mirrors (the compiled kernel's launcher takes
# every argument in signature order, constexprs included): 3.6.0 tested on the GPU by
# tests/kernels/test_fast_launch.py, 3.9.0 by its key test against Triton's own specialization.
TESTED_VERSIONS = ("3.6.0", "3.9.0")

_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


class UnsupportedArgument(TypeError):
    """An argument the key does not cover: the call goes through Triton's own path."""


def version_checked(version: str = triton.__version__) -> bool:
    """Whether `version` is a Triton release the key was tested on."""
    return version in TESTED_VERSIONS


def arguments_key(args: tuple) -> list[tuple]:
    """What Triton's specialization of each runtime argument depends on, in order. Runs for every
    launch, so its checks stand in one loop rather than a call per argument; integers (strides,
    sizes), the most common, are checked first."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            width = 0 if _I32_MIN <= arg <= _I32_MAX else 1 if arg < _U64_MIN else 2
            key.append((arg == 1, arg % 16 == 0, width))
        elif kind is torch.Tensor or isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif kind is float:
            key.append((float,))
        else:
            raise UnsupportedArgument(kind.__name__)
    return key


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set: None or a callable (3.6), an empty or non-empty HookChain
    (3.9)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class FastKernel:
    """A @triton.jit kernel, launched as `kernel[grid](*runtime_args, **constexprs_and_options)`;
    every other attribute is the kernel's own."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}
        # NVIDIA's backend only: AMD's also specializes a tensor on whether its storage is under
        # 2 GB (buffer ops), which the key does not hold.
        self._enabled = (
            JITFunction is not None
            and isinstance(kernel, JITFunction)
            and version_checked()
            and torch.version.hip is None
        )
        if self._enabled:
            params = kernel.params
            n_runtime = sum(not p.is_constexpr for p in params)
            # runtime arguments first, then constexprs: the positional arguments are then exactly
            # the runtime ones, and the constexprs follow them in signature order
            self._enabled = all(not p.is_constexpr for p in params[:n_runtime])
            self._n_runtime = n_runtime
            self._constexprs = tuple((p.name, p.default) for p in params[n_runtime:])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid: tuple[int, ...]):
        if not self._enabled or type(grid) is not tuple:
            return lambda *args, **kwargs: (
                None if on_meta(args) else self.kernel[grid](*args, **kwargs)
            )
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if on_meta(args):
            return
        try:
            if len(args) != self._n_runtime or _launch_hooks_set():
                raise UnsupportedArgument("arguments or launch hook")
            device = torch.cuda.current_device() if _cuda_devices() > 1 else 0
            key = (device, *kwargs.items(), *arguments_key(args))
        except UnsupportedArgument:
            self.kernel[grid](*args, **kwargs)
            return
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)  # compiles if new, and launches
            constexprs = tuple(
                kwargs[name] if name in kwargs else default for name, default in self._constexprs
            )
            if compiled is not None and inspect.Parameter.empty not in constexprs:
                # the launcher, once launched: the compiled kernel's handles are loaded
                self._compiled[key] = (
                    compiled.run,
                    compiled.function,
                    compiled.packed_metadata,
                    constexprs,
                )
            return
        launcher, function, metadata, constexprs = entry
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        # no launch metadata and no hooks: a hook set sends calls through Triton (above)
        launcher(grid[0], grid_y, grid_z, stream, function, metadata, None, None, None, *args,
                 *constexprs)  # fmt: skip


def on_meta(args: tuple) -> bool:
    """Whether a launch's first tensor argument is on the meta device. Such a launch does
    nothing: meta tensors hold no data, and the traced step (memplan/traced) runs the launchers
    on them only to see what they allocate."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.is_meta
    return False


def fast_launch(kernel: Any) -> FastKernel:
    """Decorator, above @triton.jit."""
    return FastKernel(kernel)
