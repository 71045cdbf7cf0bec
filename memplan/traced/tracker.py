"""Every storage a traced step allocates and releases, in order, as the CUDA caching allocator
would see them.

A TorchDispatchMode sits below autograd and sees every aten op on the meta tensors: an output
whose storage it has not seen is an allocation, and a weakref callback on that storage records
its release when the last tensor or autograd node holding it lets go (storages keep their Python
object while the C++ storage lives, so the callback fires exactly then). What a CUDA kernel
allocates beside its outputs is added by name: the cuBLAS workspace of each thread's first GEMM,
and the blocks of cuda_scratch (attention and softmax backward, sorts, reductions' casts and
staging buffers).
Where autograd sums two gradients of one tensor it adds the second into the first on the GPU,
and out of place under any dispatch mode: the tracker adds in place where the GPU would
(sums_gradients_in_place)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memplan.traced.cuda_reduce import CudaDevice
from memplan.traced.cuda_scratch import Scratch, scratch_blocks
from memplan.traced.sdpa import adds_mask_in_place

# Ops that run on a cuBLAS handle: the first one on a thread creates that thread's workspace.
GEMM_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "addr", "dot", "vdot", "_scaled_mm"}
)


# Values a model's code reads from tensors (`if tensor.all():`), which meta tensors do not hold,
# by the function that reads them: the answer the protocol's batch (one unpadded sequence per
# row, position ids 0..seq-1) gives on the GPU.
KNOWN_READS: dict[str, bool | float] = {
    # transformers.masking_utils: "no row packs several sequences"
    "find_packed_sequence_indices": True,
    # torch's Adafactor scales its step by the parameter's norm (a number, not a size)
    "_single_tensor_adafactor": 1.0,
}
_READ_OPS = frozenset({"_local_scalar_dense", "is_nonzero"})


def check_no_host_copy(func: Any, args: tuple, kwargs: dict) -> None:
    """DataDependentRead where an op copies a meta tensor to the host: its values do not
    exist."""
    if func.overloadpacket.__name__ != "_to_copy" or args[0].device.type != "meta":
        return
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cpu":
        raise DataDependentRead(f"it copies a tensor to the host in {_model_frame()}")


def sums_gradients_in_place(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` is autograd's engine summing a second gradient of one tensor into the
    first (InputBuffer::accumulate: `first + second` from C++, grad mode off) where CUDA adds
    in place: the first is dense and held by the buffer alone (can_accumulate_inplace). Under a
    dispatch mode torch takes every tensor for a subclass and adds out of place, which would
    make one more gradient-sized block each time (an H100 trace's tied embedding: 622 MB)."""
    if func is not torch.ops.aten.add.Tensor or kwargs or torch.is_grad_enabled():
        return False
    if torch._C._current_autograd_node() is None or not _called_by_engine():
        return False
    first, second = args
    return (
        isinstance(first, torch.Tensor)
        and isinstance(second, torch.Tensor)
        and first.device.type == "meta"
        and first.shape == second.shape
        and first.dtype == second.dtype
        and is_non_overlapping_and_dense_or_false(first)
        and _held_once(first)
    )


def _held_once(t: torch.Tensor) -> bool:
    """No other tensor shares t's storage (the count includes the storage object asked for)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


# Where the autograd engine is entered from Python, and the files of torch's dispatch to this
# mode: between the two, the engine's own sums pass no other Python frame (a custom Function's
# backward or a checkpointed layer's recomputation does).
_ENGINE_ENTRIES = ("/torch/autograd/graph.py", "/torch/autograd/__init__.py")
_DISPATCH = (
    "/memplan/traced/tracker.py",
    "/torch/utils/_",
    "/torch/_dynamo/",
    "/torch/_compile.py",
)


def _callers() -> Iterator[FrameType]:
    """The frames that called the caller of this, innermost first."""
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _called_by_engine() -> bool:
    for frame in _callers():
        path = frame.f_code.co_filename
        if path.endswith(_ENGINE_ENTRIES):
            return True
        if not any(part in path for part in _DISPATCH):
            return False
    return False


class DataDependentRead(RuntimeError):
    """The model's code branches on a tensor's value, which a meta tensor does not have."""


def known_read() -> bool | float:
    for frame in _callers():
        if frame.f_code.co_name in KNOWN_READS:
            return KNOWN_READS[frame.f_code.co_name]
    caller = _model_frame()
    raise DataDependentRead(f"it reads a value from a tensor in {caller}")


_INTERNAL = (
    "/memplan/traced/",
    "/torch/_ops.py",
    "/torch/_compile.py",
    "/torch/_dynamo/",
    "/torch/utils/_",
    "/torch/overrides.py",
    "/torch/_tensor.py",
)


def _model_frame() -> str:
    """file:line function of the innermost frame outside the tracer and torch's dispatch."""
    for frame in _callers():
        path = frame.f_code.co_filename
        if not any(part in path for part in _INTERNAL):
            return f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
    return "unknown code"


@dataclass
class Record:
    """One allocation (`action` "alloc") or release ("free") of storage `key`."""

    action: str
    key: int
    nbytes: int
    phase: str
    label: str


@dataclass
class Storage:
    """What is known of one allocation: its size, where it was made, and a category when the
    allocation says what it is (weights, inputs, the cuBLAS workspace, scratch, autocast copies)."""

    nbytes: int
    phase: str
    label: str
    step: int
    tag: str | None = None
    freed: bool = False


@dataclass
class Where:
    """The step's position, set by the driver (phase, step) and the module hooks (label); in
    backward `resolve` names the label from the autograd node running."""

    phase: str = "start"
    label: str = "weights + optimizer states"
    step: int = 0
    resolve: Callable[[], str] | None = None

    def current_label(self) -> str:
        return self.resolve() if self.resolve is not None else self.label


@dataclass
class Recorder:
    """The ordered allocation records of a traced run, and what each storage was."""

    where: Where = field(default_factory=Where)
    records: list[Record] = field(default_factory=list)
    storages: dict[int, Storage] = field(default_factory=dict)
    workspace_bytes: int = 32 * 2**20
    _keys: dict[int, int] = field(default_factory=dict)  # id(storage object) -> key
    _refs: dict[int, weakref.ref] = field(default_factory=dict)  # key -> its release callback
    _threads_with_workspace: set[str] = field(default_factory=set)
    _next: int = 0
    # Set when the traced steps end: the model and optimizer are released afterwards, outside
    # the step.
    closed: bool = False

    def alloc(self, nbytes: int, tag: str | None = None) -> int:
        key = self._next
        self._next += 1
        w = self.where
        label = w.current_label()
        self.storages[key] = Storage(nbytes, w.phase, label, w.step, tag)
        self.records.append(Record("alloc", key, nbytes, w.phase, label))
        return key

    def free(self, key: int) -> None:
        storage = self.storages[key]
        storage.freed = True
        w = self.where
        self.records.append(Record("free", key, storage.nbytes, w.phase, w.current_label()))

    def track(self, tensor: torch.Tensor, tag: str | None = None) -> int | None:
        """The key of the tensor's storage, recording its allocation if it is new; None for a
        tensor that holds no GPU memory (not on the meta device, or empty)."""
        if tensor.device.type != "meta":
            return None
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = self._keys.get(id(storage))
        if key is not None:
            if nbytes > self.storages[key].nbytes:  # resized in place: a new block
                self._release(id(storage), key)
                key = None
            else:
                return key
        if nbytes == 0:
            return None
        key = self.alloc(nbytes, tag)
        self._keys[id(storage)] = key
        storage_id = id(storage)
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._release(storage_id, k))
        return key

    def key_of(self, tensor: torch.Tensor) -> int | None:
        if tensor.device.type != "meta":
            return None
        return self._keys.get(id(tensor.untyped_storage()))

    def _release(self, storage_id: int, key: int) -> None:
        self._refs.pop(key, None)
        if self._keys.get(storage_id) == key:
            del self._keys[storage_id]
        if not self.storages[key].freed and not self.closed:
            self.free(key)

    def workspace(self, thread: str) -> None:
        """The cuBLAS workspace a thread's handle takes at its first GEMM, held to the end."""
        if thread not in self._threads_with_workspace:
            self._threads_with_workspace.add(thread)
            self.alloc(self.workspace_bytes, "cublas_workspace")

    def alive(self) -> dict[int, Storage]:
        return {k: s for k, s in self.storages.items() if not s.freed}


class MetaOpCache:
    """Outputs of functional aten ops by the metadata of their inputs. Most meta kernels are
    Python reference implementations (about 1 ms a call); a decoder layer repeats the same ops
    on the same shapes, so a hit builds the outputs from the recorded sizes, strides and storage
    sizes instead (a few microseconds). Ops that alias or mutate an input (views, in-place and
    out= ops) always run."""

    def __init__(self) -> None:
        self._functional: dict[Any, bool] = {}
        self._outputs: dict[tuple, tuple | None] = {}

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self._is_functional(func):
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(kwargs))
            hash(key)
        except _Unkeyable:
            return func(*args, **kwargs)
        template = self._outputs.get(key)
        if template is not None:
            return _instantiate(template)
        out = func(*args, **kwargs)
        if _aliases_input(out, args, kwargs):  # a view that its schema does not declare
            self._functional[func] = False
        elif key not in self._outputs:
            self._outputs[key] = _template(out)
        return out

    def _is_functional(self, func: Any) -> bool:
        known = self._functional.get(func)
        if known is None:
            schema = func._schema
            known = (
                not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
                and func.overloadpacket.__name__ not in _READ_OPS
            )
            self._functional[func] = known
        return known


def _aliases_input(out: Any, args: tuple, kwargs: dict) -> bool:
    inputs = {
        id(t.untyped_storage())
        for t in tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.device.type == "meta"
    }
    return any(
        id(t.untyped_storage()) in inputs
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.device.type == "meta"
    )


class _Unkeyable(Exception):
    pass


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _key(v)) for k, v in value.items())
    if value is None or isinstance(
        value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return (type(value), value)
    raise _Unkeyable


def _template(out: Any) -> tuple | None:
    """(pytree spec, leaves) with each meta tensor leaf as its storage group and layout; None
    when an output is something else than a meta tensor, an int, a float or None."""
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    groups: dict[int, int] = {}
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "meta":
                return None
            storage = leaf.untyped_storage()
            group = groups.setdefault(id(storage), len(groups))
            described.append(
                (
                    "T",
                    group,
                    storage.nbytes(),
                    leaf.dtype,
                    tuple(leaf.shape),
                    leaf.stride(),
                    leaf.storage_offset(),
                )
            )
        elif leaf is None or isinstance(leaf, (int, float, bool)):
            described.append(("V", leaf))
        else:
            return None
    return spec, tuple(described)


def _instantiate(template: tuple) -> Any:
    spec, described = template
    storages: dict[int, torch.UntypedStorage] = {}
    leaves = []
    for item in described:
        if item[0] == "V":
            leaves.append(item[1])
            continue
        _, group, nbytes, dtype, size, stride, offset = item
        storage = storages.get(group)
        if storage is None:
            storage = storages[group] = torch.UntypedStorage(nbytes, device="meta")
        empty = torch.empty((0,), dtype=dtype, device="meta")
        leaves.append(empty.set_(storage, offset, size, stride))
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _grouped_mm_output(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """torch._grouped_mm outside bf16: CUDA runs a loop of matmuls into the same output tensor
    (_grouped_mm_fallback in Blas.cpp), which the meta function refuses to describe."""
    mat_a, mat_b = args[0], args[1]
    if mat_a.dtype == torch.bfloat16:
        return None
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or mat_a.dtype
    try:
        from torch._meta_registrations import _create_grouped_mm_output_tensor
    except ImportError:  # a torch without the helper: the bf16 output's shape, in out_dtype
        shape = torch.ops.aten._grouped_mm(
            mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), offs
        ).shape
        return torch.empty(shape, dtype=out_dtype, device="meta")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


def _bincount_output(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """torch.bincount has no meta kernel (its length is the largest value + 1). Models count
    expert indices with minlength=num_experts (the MoE load-balancing loss), whose values are
    below it: the output has minlength entries."""
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    if x.device.type != "meta":
        return None
    if not minlength:
        raise DataDependentRead(f"torch.bincount without minlength in {_model_frame()}")
    if weights is None:
        dtype = torch.int64
    else:
        dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
    return torch.empty(minlength, dtype=dtype, device="meta")


# Ops whose outputs the tracer makes itself: no meta kernel, or one stricter than CUDA's.
_META_OUTPUTS = {"_grouped_mm": _grouped_mm_output, "bincount": _bincount_output}


class AllocationTracker(TorchDispatchMode):
    """Records the allocations of every aten op run under it into `recorder`."""

    def __init__(
        self,
        recorder: Recorder,
        cache: MetaOpCache | None = None,
        device: CudaDevice | None = None,
    ) -> None:
        super().__init__()
        self.recorder = recorder
        self.cache = cache if cache is not None else MetaOpCache()
        self.device = device or CudaDevice()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        recorder = self.recorder
        name = func.overloadpacket.__name__
        if name in _READ_OPS and args[0].device.type == "meta":
            return known_read()
        check_no_host_copy(func, args, kwargs)
        if sums_gradients_in_place(func, args, kwargs):
            return args[0].add_(args[1])
        if adds_mask_in_place(func, args, kwargs):
            # autograd recorded an out-of-place add: its output is a new tensor on that storage
            return torch.ops.aten.alias(args[0].add_(args[1]))
        special = _META_OUTPUTS.get(name)
        out = special(args, kwargs) if special else None
        if out is None:
            out = self.cache.run(func, args, kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                recorder.track(leaf)
        if name in GEMM_OPS:
            # After the op's output (ATen allocates it before it calls cuBLAS); the autograd
            # engine runs CUDA backward on a thread of its own, with its own handle.
            recorder.workspace("autograd" if recorder.where.phase == "backward" else "main")
        allocate_scratch(recorder, scratch_blocks(func, args, kwargs, out, self.device))
        return out


def allocate_scratch(recorder: Recorder, blocks: Scratch) -> None:
    """Allocate a kernel's scratch blocks in order and free them in reverse; a nested list's
    blocks are allocated and freed in between (one launch of several)."""
    keys = []
    for block in blocks:
        if isinstance(block, list):
            allocate_scratch(recorder, block)
        else:
            keys.append(recorder.alloc(block, "transient"))
    for key in reversed(keys):
        recorder.free(key)
