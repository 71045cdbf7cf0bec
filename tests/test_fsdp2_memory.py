"""The FSDP2 model (memplan/estimators/parallel.py) against FSDP2 itself: a tiny Llama prepared as
memplan verify prepares it (accelerate's fsdp2_prepare_model over a fake process group of N
ranks, on the CPU), trained two steps while every storage is tracked, those FSDP2 owns told
apart (rank 0's shards, gathered weights, all-gather and reduce-scatter buffers, unsharded and
sharded gradients, optimizer states and the step's temporaries). Their bytes alive at each
point of the run, peak and end of each phase, equal the analytic walk's to the byte. Under CPU
offload (CPUOffloadPolicy) the bytes compared are those a GPU would hold: the shards, their
gradients and the optimizer's states are the host's."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import weakref

import pytest
import torch

from memplan.catalog import spec_from_config
from memplan.estimators.timeline import step_sizes, walk_run
from memplan.schema import TrainSetup
from memplan.verify import distributed

TINY = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 96,
    "intermediate_size": 200,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 128,
}
# The analytic walk's categories of what FSDP2 (and the optimizer) own.
OWNED = {
    "weights",
    "gradient_buckets",
    "gathered_weights",
    "all_gather_buffers",
    "reduce_scatter_buffers",
    "unsharded_gradients",
    "gradients",
    "optimizer_states",
}


class StorageLedger:
    """Every storage's allocation, growth and release, in order: a dispatch mode sees tensors
    made by ops, a patched UntypedStorage.resize_ the gathered weights FSDP2 grows and shrinks
    in place, weak references their release. A storage is owned when FSDP2's or the
    optimizer's code made it, or when it turns out to be a gradient FSDP2 reduces."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int, str]] = []  # (allocation, bytes added, phase)
        self.current: dict[int, tuple[int, int]] = {}  # storage key -> (allocation, bytes)
        self.owned: set[int] = set()
        self.phase = "build"
        self.inside = 0  # > 0 while FSDP2's or the optimizer's code runs
        self.closed = False  # the run is over: what goes after is its teardown
        self.buffer_bytes = 0
        self.marks: list[int] = []  # len(events) when the loss's backward had run
        self._next = 0

    def track(self, storage: torch.UntypedStorage, owned: bool = False) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self.current:
            allocation, old = self.current[key]
            if nbytes != old:  # resize_
                self.current[key] = (allocation, nbytes)
                self.events.append((allocation, nbytes - old, self.phase))
                if self.inside:
                    self.owned.add(allocation)
            return
        if nbytes == 0:
            return
        allocation, self._next = self._next, self._next + 1
        self.current[key] = (allocation, nbytes)
        self.events.append((allocation, nbytes, self.phase))
        # optimizer step counters are CPU scalars on a GPU too: not the GPU's memory
        if owned or (self.inside and nbytes > 8):
            self.owned.add(allocation)
        weakref.finalize(storage, self._release, key, allocation)

    def _release(self, key: int, allocation: int) -> None:
        if not self.closed and self.current.get(key, (None,))[0] == allocation:
            _, nbytes = self.current.pop(key)
            self.events.append((allocation, -nbytes, self.phase))

    def own(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage()._cdata
        if key in self.current:
            self.owned.add(self.current[key][0])

    def disown(self, tensor: torch.Tensor) -> None:
        """Leave a storage out of the owned bytes, from its allocation on (the host's)."""
        key = _local(tensor).untyped_storage()._cdata
        if key in self.current:
            self.owned.discard(self.current[key][0])

    def owned_at_marks(self) -> list[int]:
        """Owned bytes alive at each mark."""
        return [
            sum(delta for allocation, delta, _ in self.events[:mark] if allocation in self.owned)
            for mark in self.marks
        ]

    def owned_trace(self) -> list[tuple[str, int]]:
        """(phase, owned bytes alive) after each event."""
        total, trace = 0, []
        for allocation, delta, phase in self.events:
            if allocation in self.owned:
                total += delta
                trace.append((phase, total))
        return trace


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    while isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor


def _inside(ledger: StorageLedger, fn):
    """fn, with what it allocates counted as owned."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        ledger.inside += 1
        try:
            return fn(*args, **kwargs)
        finally:
            ledger.inside -= 1

    return wrapped


@contextlib.contextmanager
def tracking(ledger: StorageLedger, host_optimizer: bool = False):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _local(t).device.type == "cpu":
                    ledger.track(_local(t).untyped_storage())
            if func is torch.ops.aten._log_softmax_backward_data.default:
                ledger.marks.append(len(ledger.events))
            return out

    def inside(fn):
        return _inside(ledger, fn)

    def post_backward(fn):
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            for param in self.fsdp_params:  # the unsharded gradients autograd wrote
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None and unsharded.grad is not None:
                    ledger.own(unsharded.grad)
            return inside(fn)(self, *args, **kwargs)

        return wrapped

    resize = torch.UntypedStorage.resize_

    def tracked_resize(storage, nbytes):
        out = resize(storage, nbytes)
        ledger.track(storage)
        return out

    patches = [
        (group_module, "foreach_all_gather"),
        (group_module, "foreach_all_gather_copy_out"),
        (group_module, "foreach_reduce"),
        (group_module.FSDPParamGroup, "reshard"),
    ]
    if not host_optimizer:  # under offload the optimizer steps on the host
        patches.append((torch.optim.AdamW, "step"))
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    saved.append(
        (group_module.FSDPParamGroup, "post_backward", group_module.FSDPParamGroup.post_backward)
    )
    try:
        for obj, name, fn in saved[:-1]:
            setattr(obj, name, inside(fn))
        group_module.FSDPParamGroup.post_backward = post_backward(saved[-1][2])
        torch.UntypedStorage.resize_ = tracked_resize
        with Mode():
            yield
    finally:
        torch.UntypedStorage.resize_ = resize
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def measure_ddp(setup: TrainSetup, config: dict) -> StorageLedger:
    """DDP over a one-rank gloo group: the reducer's buckets (made in its constructor and
    rebuilt in the second step's forward), the parameters' gradients, the optimizer's."""
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(setup, config)
    ledger = StorageLedger()
    ledger.buffer_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    distributed.init_process_group(setup, "cpu")
    init, pre_forward = DistributedDataParallel.__init__, DistributedDataParallel._pre_forward
    try:
        with tracking(ledger):
            for param in model.parameters():
                ledger.track(param.untyped_storage(), owned=True)
            DistributedDataParallel.__init__ = _inside(ledger, init)
            DistributedDataParallel._pre_forward = _inside(ledger, pre_forward)
            model = distributed.prepare(model, setup, "cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
            ids = torch.randint(0, config["vocab_size"], (setup.batch, setup.seq))
            for step in range(2):
                ledger.phase = f"step {step} forward"
                loss = model(input_ids=ids, labels=ids).loss
                ledger.phase = f"step {step} backward"
                loss.backward()
                del loss
                for param in model.parameters():
                    ledger.own(param.grad)
                ledger.phase = f"step {step} optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
            ledger.closed = True
    finally:
        DistributedDataParallel.__init__, DistributedDataParallel._pre_forward = init, pre_forward
        distributed.destroy_process_group()
    return ledger


def build_model(setup: TrainSetup, config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **fields), dtype=dtype, attn_implementation="sdpa"
    ).train()
    if setup.grad_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def copy_shards_in(model: torch.nn.Module) -> None:
    """On the CPU, FSDP2's copy of an offloaded shard to its device returns the shard itself; a
    device of another index (cpu:0) makes it the copy that a GPU makes."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    assert fsdp_param.offload_to_cpu and not fsdp_param.pin_memory
                    fsdp_param.device = torch.device("cpu", 0)


def measure(setup: TrainSetup, config: dict) -> StorageLedger:
    model = build_model(setup, config)
    ledger = StorageLedger()
    distributed.init_process_group(setup, "cpu")
    offload = setup.cpu_offload
    try:
        model = distributed.prepare(model, setup, "cpu")
        if offload:
            copy_shards_in(model)
        with tracking(ledger, host_optimizer=offload):
            for param in model.parameters():
                if not offload:  # offloaded shards are the host's
                    ledger.track(_local(param).untyped_storage(), owned=True)
            ledger.phase = "step 0 forward"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
            ids = torch.randint(0, config["vocab_size"], (setup.batch, setup.seq))
            for step in range(2):
                for micro in range(setup.grad_accum):
                    last = micro == setup.grad_accum - 1
                    model.set_requires_gradient_sync(last)
                    ledger.phase = f"step {step} forward"
                    loss = model(input_ids=ids, labels=ids).loss
                    ledger.phase = f"step {step} backward"
                    loss.backward()
                    del loss
                for param in model.parameters():  # the sharded gradients: the host's
                    if offload and param.grad is not None:
                        ledger.disown(param.grad)
                ledger.phase = f"step {step} optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
            ledger.closed = True
    finally:
        distributed.destroy_process_group()
    return ledger


def predict(setup: TrainSetup, config: dict, until: str | None = None) -> list[list[int]]:
    """The analytic walk's owned bytes alive after each event (raw: the CPU rounds nothing),
    per step (the walk plays the build, step 1 and one steady step); with `until`, each step's
    list ends before the first event of that label. Under offload the reduced gradients, which
    the host gets, are left out as the measurement leaves them out."""
    owned = OWNED - {"gradients"} if setup.cpu_offload else OWNED
    spec = spec_from_config(config)
    sizes = step_sizes(spec, setup, None, "cpu")
    _, log = walk_run(spec, setup, sizes, steady_steps=1, record=True)
    steps: list[list[int]] = [[]]
    total, live, previous, stopped, starts = 0, {}, "start", False, 0
    for event in log.events:
        new_step = previous == "optimizer" and event.phase != "optimizer"
        if event.phase == "start" and previous != "start":  # a micro-step begins
            starts += 1
            # under offload no optimizer event on the device marks the step's end
            new_step = new_step or (setup.cpu_offload and starts % setup.grad_accum == 0)
        if new_step:
            steps.append([])
            stopped = False
        previous = event.phase
        stopped = stopped or event.label == until
        optimizer_temporary = event.phase == "optimizer" and event.category == "transient"
        if event.category not in owned and not optimizer_temporary:
            continue
        if event.action == "alloc":
            live[event.tensor] = event.nbytes
            total += event.nbytes
        else:
            total -= live.pop(event.tensor)
        if not stopped:
            steps[-1].append(total)
    return steps


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"gpus": 4}, id="bf16"),
        pytest.param(
            {"gpus": 3, "precision": "amp-bf16", "tie_word_embeddings": True},
            id="amp-tied-uneven",
        ),
        pytest.param(
            {"gpus": 8, "reshard_after_forward": False, "precision": "fp32"},
            id="fp32-keep",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"gpus": 4, "grad_checkpointing": True, "grad_accum": 2},
            id="ckpt-accum",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_fsdp2_owns_what_the_model_says(options: dict) -> None:
    options = dict(options)
    config = {**TINY, "tie_word_embeddings": options.pop("tie_word_embeddings", False)}
    setup = TrainSetup(batch=2, seq=32, strategy="fsdp2", **options)
    trace = measure(setup, config).owned_trace()
    steps = predict(setup, config)
    for step in (0, 1):
        measured = [b for p, b in trace if p.startswith(f"step {step}")]
        assert measured[-1] == steps[step][-1], f"after step {step + 1}"
        if config["tie_word_embeddings"]:
            # a traced run sums the tied weight's two gradients out of place (a dispatch mode
            # keeps autograd's buffer from reusing them), so the lm_head's half, which is the
            # gradient itself on a GPU, is not among those FSDP2 reduces: the optimizer step
            # (no activations, every gradient reduced) is compared instead
            measured = [b for p, b in trace if p == f"step {step} optimizer"]
            assert max(measured) == max(steps[step][-len(measured) :]), f"step {step + 1} step"
        else:
            assert max(measured) == max(steps[step]), f"step {step + 1} peak"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"gpus": 4}, id="bf16"),
        pytest.param({"gpus": 3, "precision": "amp-bf16"}, id="amp-uneven"),
        pytest.param(
            {"gpus": 4, "grad_checkpointing": True, "grad_accum": 2},
            id="ckpt-accum",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_fsdp2_cpu_offload_holds_on_the_device_what_the_model_says(options: dict) -> None:
    """CPUOffloadPolicy: each group's shards copied in one by one (cast after the copy under
    amp) for its all-gather, the reduced shard going to the host; nothing kept between steps.
    Without accumulation every allocation and free is the walk's, though autograd writes a
    layer's gradients in an order of its own."""
    config = {**TINY, "tie_word_embeddings": False}
    setup = TrainSetup(batch=2, seq=32, strategy="fsdp2", cpu_offload=True, **options)
    ledger = measure(setup, config)
    trace, steps = ledger.owned_trace(), predict(setup, config)
    for step in (0, 1):
        measured = [b for p, b in trace if p.startswith(f"step {step}")]
        assert max(measured) == max(steps[step]), f"step {step + 1} peak"
        assert measured[-1] == steps[step][-1] == 0, f"after step {step + 1}"
        if setup.grad_accum == 1:
            assert _changes(measured) == _changes(steps[step]), f"step {step + 1} events"
    at_loss = predict(setup, config, until="logits gradient")
    # each step's first micro-step, at its loss's backward
    first = ledger.owned_at_marks()[:: setup.grad_accum]
    assert first == [at_loss[0][-1], at_loss[1][-1]]


def _changes(totals: list[int]) -> collections.Counter:
    """The allocations and frees (bytes, signed) that make a run of totals starting from 0."""
    return collections.Counter(b - a for a, b in itertools.pairwise([0, *totals]))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_prefetches_after_the_loss_backward(tied: bool) -> None:
    """The tail group's pre-backward hook sits on lm_head's output: the last layer's prefetch
    starts once the loss's backward has made the logits' gradient, not before it."""
    config = {**TINY, "tie_word_embeddings": tied}
    setup = TrainSetup(batch=2, seq=32, strategy="fsdp2", gpus=4)
    ledger = measure(setup, config)
    steps = predict(setup, config, until="logits gradient")
    assert ledger.owned_at_marks() == [steps[0][-1], steps[1][-1]]


def test_ddp_buckets_are_what_the_model_says() -> None:
    """Beside the model, DDP keeps a flat copy of the model's buffers it broadcasts (here the
    rotary inv_freq and its original, 96 bytes: one 512-byte block on a GPU)."""
    config = {**TINY, "tie_word_embeddings": False}
    setup = TrainSetup(batch=2, seq=32, strategy="ddp", gpus=4)
    ledger = measure_ddp(setup, config)
    buffers = ledger.buffer_bytes
    trace, steps = ledger.owned_trace(), predict(setup, config)
    for step in (0, 1):
        measured = [b for p, b in trace if p.startswith(f"step {step}")]
        assert max(measured) - buffers == max(steps[step]), f"step {step + 1} peak"
        assert measured[-1] - buffers == steps[step][-1], f"after step {step + 1}"
