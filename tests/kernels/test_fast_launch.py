"""memplan.kernels._launch: the direct launch of compiled kernels. Its cache key must separate
every pair of calls that Triton specializes differently (checked against Triton's own
specialization function), calls it cannot key must go through Triton, and on the GPU the direct
launches must compute what Triton's own launches do, alignment changes included."""

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from memplan.kernels import _launch
from memplan.kernels import swiglu as S
from memplan.kernels._launch import FastKernel, UnsupportedArgument, arguments_key

try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # older Triton: the key is not used there (version_checked)
    native_specialize_impl = None


def _args_for_keys() -> list[object]:
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[2:], base.bfloat16(), base.bfloat16()[8:],
               base.bfloat16()[1:], base.to(torch.int64)]  # fmt: skip
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**32, -(2**31),
            -(2**31) - 1, 2**63, 2**63 + 16, 2**64 - 1]  # fmt: skip
    return [*tensors, *ints, 0.0, 1.0, 2.5]


def _backend():
    """The backend Triton specializes with: the GPU's where there is one (its class may override
    the base rules), else the base class, whose rules NVIDIA's backend inherits."""
    if not torch.cuda.is_available():
        return BaseBackend
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    return make_backend(driver.active.get_current_target())


@pytest.mark.skipif(native_specialize_impl is None, reason="Triton without native specialization")
def test_equal_keys_mean_equal_triton_specialization():
    args = _args_for_keys()
    backend = _backend()
    specs = [native_specialize_impl(backend, a, False, True, True) for a in args]
    keys = arguments_key(tuple(args))
    for i, a in enumerate(args):
        for j, b in enumerate(args):
            if keys[i] == keys[j]:
                assert specs[i] == specs[j], (a, b, specs[i], specs[j])
    # and the key is not trivially coarse: ints 1 and 2 and tensors at other alignments differ
    one, two, sixteen, seventeen = arguments_key((1, 2, 16, 17))
    assert one != two and sixteen != seventeen
    assert keys[0] != keys[1]


def test_unkeyed_arguments_are_refused():
    for value in (True, None, "x", (1, 2), torch.float32):
        with pytest.raises(UnsupportedArgument):
            arguments_key((0, value))


def _kernel_source(x_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _FakeCompiled:
    def __init__(self, launches: list):
        self.function, self.packed_metadata = "function", "metadata"
        self.run = lambda *call: launches.append(call)


@pytest.fixture
def fake_kernel(monkeypatch):
    """A real JITFunction whose compile-and-launch path is recorded instead of run."""
    kernel = JITFunction(_kernel_source)
    triton_calls, direct = [], []

    def run(*args, grid, warmup, **kwargs):
        triton_calls.append((grid, args, kwargs))
        return _FakeCompiled(direct)

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(_launch, "_cuda_devices", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(_launch, "version_checked", lambda: True)
    return FastKernel(kernel), triton_calls, direct


def test_a_seen_specialization_is_launched_directly(fake_kernel):
    fast, triton_calls, direct = fake_kernel
    x = torch.zeros(32)
    fast[(3,)](x, 64, 0.5, BLOCK=16, num_warps=4)
    assert len(triton_calls) == 1 and not direct  # first call: Triton compiles and launches
    fast[(3, 2)](x, 80, 1.5, BLOCK=16, num_warps=4)  # same specialization: 80 % 16 == 0
    assert len(triton_calls) == 1
    # grid padded to 3 dims, stream, function, metadata, no hooks, then every argument in
    # signature order with the constexprs' values (FLAG from its default)
    assert direct == [(3, 2, 1, 7, "function", "metadata", None, None, None, x, 80, 1.5, 16, False)]


@pytest.mark.parametrize(
    "second",
    [
        ((torch.zeros(33)[1:], 64, 0.5), {"BLOCK": 16, "num_warps": 4}),  # misaligned pointer
        ((torch.zeros(32, dtype=torch.float64), 64, 0.5), {"BLOCK": 16, "num_warps": 4}),
        ((torch.zeros(32), 1, 0.5), {"BLOCK": 16, "num_warps": 4}),  # int 1: a constexpr
        ((torch.zeros(32), 65, 0.5), {"BLOCK": 16, "num_warps": 4}),  # not divisible by 16
        ((torch.zeros(32), 2**31, 0.5), {"BLOCK": 16, "num_warps": 4}),  # i64
        ((torch.zeros(32), 64, 0.5), {"BLOCK": 32, "num_warps": 4}),  # another constexpr
        ((torch.zeros(32), 64, 0.5), {"BLOCK": 16, "num_warps": 8}),  # another launch option
        ((torch.zeros(32), 64, 0.5), {"BLOCK": 16, "FLAG": True, "num_warps": 4}),
    ],
)
def test_another_specialization_goes_through_triton(fake_kernel, second):
    fast, triton_calls, direct = fake_kernel
    fast[(1,)](torch.zeros(32), 64, 0.5, BLOCK=16, num_warps=4)
    args, kwargs = second
    fast[(1,)](*args, **kwargs)
    assert len(triton_calls) == 2 and not direct


@pytest.mark.parametrize(
    "args",
    [(torch.zeros(32), True, 0.5), (torch.zeros(32), None, 0.5), (torch.zeros(32), 64)],
)
def test_calls_it_cannot_key_always_go_through_triton(fake_kernel, args):
    fast, triton_calls, direct = fake_kernel
    for _ in range(3):
        fast[(1,)](*args, BLOCK=16)
    assert len(triton_calls) == 3 and not direct


def test_a_launch_hook_sends_calls_through_triton(fake_kernel, monkeypatch):
    fast, triton_calls, direct = fake_kernel
    monkeypatch.setattr(_launch.knobs.runtime, "launch_enter_hook", lambda *a: None)
    for _ in range(3):
        fast[(1,)](torch.zeros(32), 64, 0.5, BLOCK=16)
    assert len(triton_calls) == 3 and not direct


def test_interpreter_and_unchecked_versions_use_triton_as_is(monkeypatch):
    for untested in ("3.5.1", "3.6.1", "3.7.0", "3.8.0", "3.10.0"):
        assert not _launch.version_checked(untested)
    assert _launch.version_checked("3.6.0") and _launch.version_checked("3.9.0")
    monkeypatch.setattr(_launch, "version_checked", lambda: False)
    kernel = JITFunction(_kernel_source)
    assert not FastKernel(kernel)._enabled
    assert not FastKernel(_kernel_source)._enabled  # not a JITFunction (the interpreter's)
    assert FastKernel(kernel).arg_names == kernel.arg_names  # attributes pass through


def test_rocm_uses_triton_as_is(monkeypatch):
    """AMD's backend also specializes tensors on their storage size, which the key lacks."""
    monkeypatch.setattr(_launch, "version_checked", lambda: True)
    assert FastKernel(JITFunction(_kernel_source))._enabled
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not FastKernel(JITFunction(_kernel_source))._enabled


@pytest.mark.gpu
def test_direct_launches_match_triton_across_alignments():
    """Alternating aligned and misaligned views through the same kernel: a kernel compiled for
    16-byte aligned pointers reused for a misaligned one would read wrong elements (or fault)."""
    assert isinstance(S._swiglu_forward_kernel, FastKernel) and S._swiglu_forward_kernel._enabled
    torch.manual_seed(0)
    storage = torch.randn(2, 4096 * 3 + 8, device="cuda", dtype=torch.bfloat16)
    for step in range(6):
        offset = (step % 3) * 1  # 0, 1, 2 elements: 0, 2, 4 bytes
        gate = storage[0, offset : offset + 4096 * 3].view(3, 4096)
        up = storage[1, offset : offset + 4096 * 3].view(3, 4096)
        kernel = S._swiglu_forward_kernel
        got = S.swiglu_forward(gate, up)
        kernel._enabled = False  # Triton's own launch of the same kernel
        try:
            want = S.swiglu_forward(gate, up)
        finally:
            kernel._enabled = True
        assert torch.equal(got, want), offset
    # both alignments were keyed: at least two compiled entries, each reused
    assert len(S._swiglu_forward_kernel._compiled) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_direct_launches_per_device():
    """Compiled kernels are loaded per device: the key holds the current device, so a call on
    the second GPU never launches the first GPU's kernel."""
    torch.manual_seed(0)
    for step in range(4):
        device = f"cuda:{step % 2}"
        gate = torch.randn(3, 4096, device=device, dtype=torch.bfloat16)
        up = torch.randn_like(gate)
        got = S.swiglu_forward(gate, up)
        assert got.device == gate.device
        want = S.reference_swiglu(gate.float(), up.float()).to(torch.bfloat16)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    devices = {key[0] for key in S._swiglu_forward_kernel._compiled}
    assert devices >= {0, 1}
