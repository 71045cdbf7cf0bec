"""The measurement protocol's training steps (memplan/verify/worker.py _Trainer.step) run on the
meta model under the allocation tracker: step 1 without optimizer states, then a steady step.

Each micro-step: forward with labels (under autocast for amp), backward (the loss divided by the
number of micro-steps), then the optimizer step (torch's foreach implementation, the default on
CUDA for Adam, AdamW and SGD; Adafactor's default is one tensor at a time) and
zero_grad(set_to_none=True). The loss of the last forward is held until the next forward
returns, as the worker holds it."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memplan.errors import MemplanError
from memplan.estimators.timeline import cublas_workspace_bytes
from memplan.patching.forwards import DeviceFacts
from memplan.schema import Gpu, TrainSetup
from memplan.traced.autocast import Autocast
from memplan.traced.cuda_reduce import CudaDevice
from memplan.traced.emulation import CudaSemantics
from memplan.traced.tracker import AllocationTracker, Recorder, Where
from memplan.verify import protocol

AMP_DTYPES = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}


@dataclass
class TracedRun:
    """What the tracker saw over the protocol's first steps, and what each storage turned out
    to be (the gradients and optimizer states are known only once the step has made them)."""

    recorder: Recorder
    step_starts: list[int]  # index of each step's first record (step 1, step 2, ...)
    gradients: set[int] = field(default_factory=set)
    optimizer_states: set[int] = field(default_factory=set)
    # Storages a forward made that are alive after it returns: saved for backward (and the loss)
    saved_by_forward: set[int] = field(default_factory=set)
    # Points of the step between allocations: (index of the next record, phase, label).
    marks: list[tuple[int, str, str]] = field(default_factory=list)
    params: int = 0
    trainable_params: int = 0
    lora_targets: tuple[str, ...] = ()
    attention_kernels: dict[str, int] = field(default_factory=dict)
    attention_calls: dict[Any, str] = field(default_factory=dict)  # SdpaCall -> kernel


TRACEABLE_OPTIMIZERS = ("adamw", "adamw-fused", "adam", "sgd", "sgd-momentum", "adafactor")


def make_optimizer(params: list[torch.Tensor], name: str) -> Any:
    """The worker's optimizer, with the implementation torch picks on CUDA (foreach for Adam,
    AdamW and SGD; on the meta device torch would pick the per-tensor loop)."""
    lr = protocol.LEARNING_RATE
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if name == "adamw-fused":
        return _FusedAdamW(params, lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=protocol.SGD_MOMENTUM, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    raise MemplanError(
        f"the traced estimate does not model the {name} optimizer (bitsandbytes' kernels "
        "allocate outside torch's view); use adamw, adam, sgd, sgd-momentum or adafactor"
    )


class _FusedAdamW(torch.optim.AdamW):
    """torch's fused AdamW, whose state initialization refuses meta parameters: the state is made
    here as torch makes it for fused (per parameter: the step count as a tensor on its device,
    then exp_avg and exp_avg_sq), and the fused kernel's meta function gives the update."""

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, lr=lr, foreach=False)
        for group in self.param_groups:
            group["fused"] = True
        self.defaults["fused"] = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.grad is None or state:
                    continue
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return super().step(closure)


class ModuleLabels:
    """Where the step is, by module: 'embedding', 'layer 3', 'final norm', then 'lm_head' and
    'loss' in the loss phase. In backward an op is labelled by the autograd node running it,
    whose sequence number falls in the forward range of one of those modules."""

    def __init__(self, model: Any, where: Where, config: Any) -> None:
        self.where = where
        self.bounds: list[int] = []  # sequence number of the last node of each labelled span
        self.names: list[str] = []
        self.last_backward = "loss backward"
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.layers = decoder_layers(base, config)
        self.head = base.get_output_embeddings()
        self.embedding = base.get_input_embeddings()
        self.handles: list[Any] = []
        if self.embedding is not None:
            self._hook(self.embedding, "embedding", None)
        for index, layer in enumerate(self.layers):
            after = "final norm" if index == len(self.layers) - 1 else None
            self._hook(layer, f"layer {index}", after)
        if self.head is not None:
            self.handles.append(self.head.register_forward_pre_hook(self._head_pre))
            self.handles.append(self.head.register_forward_hook(self._head_post))

    def _hook(self, module: Any, label: str, after: str | None) -> None:
        def pre(_module: Any, _args: Any) -> None:
            if self.where.phase != "backward":
                self.where.label = label

        def post(_module: Any, _args: Any, output: Any) -> None:
            if self.where.phase == "backward":
                return
            self._bound(output, label)
            if after:
                self.where.label = after

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def _head_pre(self, _module: Any, args: Any) -> None:
        if self.where.phase == "backward":
            return
        self._bound(args, self.where.label)
        self.where.phase, self.where.label = "loss", "lm_head"

    def _head_post(self, _module: Any, _args: Any, output: Any) -> None:
        if self.where.phase == "backward":
            return
        self._bound(output, "lm_head")
        self.where.label = "loss"

    def _bound(self, value: Any, label: str) -> None:
        seq = _last_sequence_nr(value)
        if seq is not None and (not self.bounds or seq > self.bounds[-1]):
            self.bounds.append(seq)
            self.names.append(label)

    def start_forward(self) -> None:
        self.bounds.clear()
        self.names.clear()
        self.where.phase, self.where.label = "forward", "embedding"

    def end_forward(self, loss: Any) -> None:
        self._bound(loss, "loss")

    def backward_label(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            index = bisect.bisect_left(self.bounds, node._sequence_nr())
            if index < len(self.bounds):
                self.last_backward = f"{self.names[index]} backward"
        return self.last_backward

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def decoder_layers(model: Any, config: Any) -> list[Any]:
    """The repeated decoder layers: the ModuleList of num_hidden_layers modules (else the
    longest ModuleList)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    count = _text_config(config).get("num_hidden_layers") if config is not None else None
    exact = [m for m in lists if len(m) == count]
    return list(exact[0] if exact else max(lists, key=len))


def _text_config(config: Any) -> dict[str, Any]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text.to_dict() if hasattr(text, "to_dict") else {}


def _last_sequence_nr(value: Any) -> int | None:
    for leaf in torch.utils._pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
            return leaf.grad_fn._sequence_nr()
    return None


class _CheckpointRegions:
    """torch.utils.checkpoint's context_fn. The autograd engine runs a checkpointed layer's
    recomputation without the forward's torch-function mode, so its recompute context enters
    the CUDA semantics again; and on CUDA the recomputation runs in an autocast region of its
    own (torch restores the forward's autocast state), whose weight-cast cache is cleared when
    it ends."""

    def __init__(self) -> None:
        self.semantics: CudaSemantics | None = None

    def __call__(self) -> tuple[Any, Any]:
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        semantics = self.semantics
        if semantics is None:
            yield
            return
        autocast = semantics.autocast
        before = autocast.enabled if autocast else False
        if autocast is not None:
            autocast.enabled = True
        try:
            with semantics.copy():
                yield
        finally:
            if autocast is not None:
                autocast.enabled = before
                if not before:
                    autocast.clear()


def trace_steps(
    config: Any,
    setup: TrainSetup,
    gpu: Gpu | None = None,
    *,
    steps: int = 2,
    trust_remote_code: bool = False,
) -> TracedRun:
    """Build the model of `config` (a transformers config) on the meta device and trace the
    protocol's first `steps` steps."""
    from memplan.traced.model import build_model, quiet

    amp = AMP_DTYPES.get(setup.precision)
    regions = _CheckpointRegions()
    recorder = Recorder(workspace_bytes=cublas_workspace_bytes(gpu))
    run = TracedRun(recorder=recorder, step_starts=[])
    autocast = (
        Autocast(amp, on_cached=lambda t: _tag(recorder, t, "autocast_cache")) if amp else None
    )
    model = build_model(
        config,
        setup,
        trust_remote_code=trust_remote_code,
        checkpoint_context=regions,
        device_facts=device_facts(gpu, autocast),
        on_built=lambda built: record_build(recorder, built),
    )
    capability = gpu.compute_capability if gpu else (9, 0)
    semantics = CudaSemantics(autocast, capability)
    regions.semantics = semantics
    labels = ModuleLabels(model, recorder.where, getattr(model, "config", config))
    rotary_hooks = rotary_embeddings_without_autocast(model, autocast)
    where = recorder.where

    for tensor in [*model.parameters(), *model.buffers()]:  # LoRA's adapters: made after
        recorder.track(tensor, "weights")
    params = [p for p in model.parameters() if p.requires_grad]
    run.params = sum(p.numel() for p in model.parameters())
    run.trainable_params = sum(p.numel() for p in params)
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        targets = next(iter(peft_config.values())).target_modules
        run.lora_targets = tuple(sorted(targets)) if targets else ()
    vocab = _text_config(getattr(model, "config", config)).get("vocab_size") or 2
    try:
        device = CudaDevice.of(gpu.sm_count if gpu else None, capability)
        with quiet(), AllocationTracker(recorder, device=device), semantics:
            ids = torch.randint(0, vocab, (setup.batch, setup.seq), device="meta")
            _tag(recorder, ids, "inputs")
            opt = make_optimizer(params, setup.optimizer)
            held: dict[str, Any] = {}
            for step in range(1, steps + 1):
                where.step = step
                run.step_starts.append(len(recorder.records))
                _one_step(model, opt, ids, setup, run, labels, autocast, held)
    except MemplanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's code failed on meta tensors
        raise MemplanError(
            f"the model's code could not run on meta tensors, so no traced estimate can be made "
            f"({where.phase}, {where.label}): {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    finally:
        recorder.closed = True
        labels.remove()
        for handle in rotary_hooks:
            handle.remove()
    run.attention_kernels = dict(semantics.kernels)
    run.attention_calls = dict(semantics.calls)
    return run


def record_build(recorder: Recorder, model: Any) -> None:
    """The weights as the GPU's build allocates them: every parameter and buffer in registration
    order, then, where the output embedding is tied to the input embedding, a block of the
    embedding's size allocated and released (transformers gives the head a weight of its own
    before tying it: every tied model's H100 allocation trace has it; the cached block is where
    large tensors of the first step land)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        recorder.track(tensor, "weights")
    tied = tied_head_bytes(model)
    if tied:
        recorder.free(recorder.alloc(tied, "transient"))


def tied_head_bytes(model: Any) -> int:
    """Bytes of the output embedding's weight where it is the input embedding's, else 0."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or embedding is None or weight is not getattr(embedding, "weight", None):
        return 0
    return weight.untyped_storage().nbytes()


def device_facts(gpu: Gpu | None, autocast: Autocast | None) -> DeviceFacts:
    """What memplan's kernels are told of the GPU the meta tensors stand for: its SM count and
    the emulated autocast's dtype while it is on."""

    def autocast_dtype() -> torch.dtype | None:
        return autocast.dtype if autocast is not None and autocast.enabled else None

    return DeviceFacts(sm_count=gpu.sm_count if gpu else None, autocast=autocast_dtype)


def rotary_embeddings_without_autocast(model: Any, autocast: Autocast | None) -> list[Any]:
    """Hooks that switch the emulated autocast off in each rotary embedding's forward, as
    transformers' maybe_autocast(enabled=False) does on CUDA (on meta tensors it is a no-op):
    cos/sin are computed in fp32, and stay fp32 where the family does not cast them (OLMo)."""
    if autocast is None:
        return []
    handles = []
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        before: list[bool] = []

        def enter(_module: Any, _args: Any, before: list[bool] = before) -> None:
            before.append(autocast.enabled)
            autocast.enabled = False

        def leave(_module: Any, _args: Any, _out: Any, before: list[bool] = before) -> None:
            autocast.enabled = before.pop()

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def _one_step(
    model: Any,
    opt: Any,
    ids: torch.Tensor,
    setup: TrainSetup,
    run: TracedRun,
    labels: ModuleLabels,
    autocast: Autocast | None,
    held: dict[str, Any],
) -> None:
    recorder, where = run.recorder, run.recorder.where
    for _ in range(setup.grad_accum):
        labels.start_forward()
        first = len(recorder.records)
        if autocast is not None:
            autocast.enabled = True
        try:
            held["loss"] = model(input_ids=ids, labels=ids).loss
        finally:
            if autocast is not None:
                autocast.enabled = False
                autocast.clear()
        labels.end_forward(held["loss"])
        run.marks.append((len(recorder.records), "forward", "end of forward"))
        alive = recorder.alive()
        run.saved_by_forward |= {
            r.key
            for r in recorder.records[first:]
            if r.action == "alloc"
            and r.key in alive
            and alive[r.key].tag in (None, "autocast_cache")
        }
        where.phase, where.label = "backward", "loss backward"
        where.resolve = labels.backward_label
        loss = held["loss"] if setup.grad_accum == 1 else held["loss"] / setup.grad_accum
        try:
            loss.backward()
        finally:
            where.resolve = None
        del loss
    for p in model.parameters():
        if p.grad is not None:
            key = recorder.key_of(p.grad)
            if key is not None:
                run.gradients.add(key)
    run.marks.append((len(recorder.records), "backward", "end of backward"))
    where.phase, where.label = "optimizer", "optimizer step"
    opt.step()
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                key = recorder.key_of(value)
                if key is not None:
                    run.optimizer_states.add(key)
    where.phase, where.label = "zero_grad", "zero_grad"
    opt.zero_grad(set_to_none=True)
    where.phase, where.label = "end", "end of step"


def _tag(recorder: Recorder, tensor: torch.Tensor, tag: str) -> None:
    key = recorder.key_of(tensor)
    if key is not None:
        recorder.storages[key].tag = tag


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= 200 else text[:197] + "..."
