"""What data parallelism adds to, or takes from, one rank's training step, as allocations the step
walk (timeline.py) plays at its points: the model's parts in the order they run (embedding,
decoder layers, the tail of final norm and lm_head), entered and left in forward and backward.

- OneGpu: the protocol's single GPU; whole weights, gradients kept as autograd writes them.
- Ddp: torch's DistributedDataParallel as accelerate builds it: the reducer's gradient buckets
  (a second copy of every gradient, kept from construction on) on top of one GPU's step.
- Fsdp2: fully_shard as accelerate's FSDP2 plugin wraps a causal LM: a group per decoder
  layer, the untied embedding, the tail [final norm, lm_head] (with the tied embedding); padded
  shards, all-gathers, reduce-scatters, in the order and on the lifetimes of torch 2.11's
  FSDP2 (docs/distributed.md).
- Zero: DeepSpeed ZeRO stages 1-3 as accelerate configures them; predicted, not measured.

Under CPU offload (FSDP2's CPUOffloadPolicy, ZeRO's offload_optimizer / offload_param) what the
host holds leaves the walk: the layouts say so (optimizer_on_host) and host.py counts it.

Rank 0 is modelled: FSDP2 gives it ceil(rows / N) rows of every parameter, the largest shard."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memplan.errors import UsageError
from memplan.estimators.contracts import FP32, LORA_TARGET_STAGE, DtypePlan
from memplan.estimators.param_tensors import Shape, param_shapes
from memplan.estimators.params import lora_shapes, lora_targets_modelled
from memplan.families import FAMILIES
from memplan.schema import SHARDING_STRATEGIES, ModelSpec, TrainSetup

if TYPE_CHECKING:  # the walk imports this module
    from memplan.estimators.timeline import RunTensors, StepBuilder

MIB = 2**20
# The CUDA streams FSDP2 allocates on beside the default one: the all-gather copy-in stream
# (copy-ins and all-gather outputs) and the reduce-scatter stream (the reduced shards and
# their casts: the sharded gradients).
ALL_GATHER_STREAM = 1
REDUCE_SCATTER_STREAM = 2
# DDP's reducer: the first bucket closes at 1 MiB, the others at 25 MiB (torch's defaults,
# which accelerate does not change); a bucket closes once it reaches its cap.
DDP_FIRST_BUCKET = 1 * MIB
DDP_BUCKET = 25 * MIB


@dataclass(frozen=True)
class Param:
    """One parameter as a strategy sees it: its (rows, columns), the part of the model whose
    backward writes its gradient, its bytes per element as stored and as computed with, and
    whether it trains."""

    shape: Shape
    part: str  # attention | mlp | norms | embedding | final_norm | lm_head
    stored: int
    computed: int
    trainable: bool

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def shard(self, ranks: int) -> int:
        """Elements of rank 0's padded shard: ceil(rows / N) rows."""
        return -(-self.shape[0] // ranks) * self.shape[1]


@dataclass(frozen=True)
class Group:
    """One FSDP2 unit (fully_shard call): its parameters, in registration order."""

    params: tuple[Param, ...]
    reshard_after_forward: bool

    @property
    def trainable(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.trainable)


def model_groups(spec: ModelSpec, setup: TrainSetup) -> dict[str, Group]:
    """The parameters of the embedding, one decoder layer and the tail, as accelerate's FSDP2
    plugin groups them: a tied embedding joins the tail [final norm, embedding] (the lm_head is
    the same tensor); under LoRA only the adapters (fp32) train, each after its layer's base
    weights. Under autocast (amp-*) the weights are stored in fp32 and gathered in the
    autocast dtype; otherwise both in the model's dtype."""
    dtypes = DtypePlan.of(setup.precision)
    stored = dtypes.param
    computed = dtypes.proj if dtypes.autocast else stored
    base_trains = not setup.lora_rank
    shapes = param_shapes(spec)

    def params(part: str, tensors: tuple[Shape, ...]) -> list[Param]:
        return [Param(s, part, stored, computed, base_trains) for s in tensors]

    layer = params("attention", shapes.attention) + params("mlp", shapes.mlp)
    layer += params("norms", shapes.norms)
    if setup.lora_rank:
        adapter_computed = computed if dtypes.autocast else FP32
        for target, (fan_in, fan_out) in zip(
            lora_targets_modelled(spec, setup), lora_shapes(spec, setup)
        ):
            part = "mlp" if LORA_TARGET_STAGE[target] >= 2 else "attention"
            for shape in ((setup.lora_rank, fan_in), (fan_out, setup.lora_rank)):
                layer.append(Param(shape, part, FP32, adapter_computed, True))
    embedding = params("embedding", (shapes.embedding,))
    tail = params("final_norm", shapes.final_norm)
    tail += embedding if shapes.lm_head is None else params("lm_head", (shapes.lm_head,))
    reshard = setup.reshard_after_forward
    groups = {
        "layer": Group(tuple(layer), reshard),
        "tail": Group(tuple(tail), False),
    }
    if shapes.lm_head is not None:
        groups["embedding"] = Group(tuple(embedding), reshard)
    return groups


class OneGpu:
    """One GPU as the protocol runs it; the walk's own gradient sizes, no collective."""

    # The whole model is made on this GPU, module by module (from_config under torch.device).
    builds_whole_model = True

    def __init__(self, spec: ModelSpec, setup: TrainSetup) -> None:
        self.spec, self.setup = spec, setup
        self.steady = False  # the step walked has optimizer states (not the first)

    def weight_tensors(
        self, elements: list[int], adapters: list[int], param_bytes: int
    ) -> list[int]:
        """Bytes of each weight the build allocates, in order."""
        return [n * param_bytes for n in elements] + [n * FP32 for n in adapters]

    def prepare(self, builder: StepBuilder, param_bytes: int, trainable: list[int]) -> list[int]:
        """What the strategy allocates once the model is built and keeps (DDP's buckets)."""
        return []

    def step_start(self, builder: StepBuilder, step: int, buffers: list[int]) -> list[int]:
        """The kept buffers as the step (0: the first) starts with them."""
        return buffers

    def local_trainable(self, trainable: list[int]) -> list[int]:
        """Elements of each trainable tensor this rank's optimizer steps."""
        return trainable

    def gradient_bytes(self, param_bytes: int) -> int:
        """Bytes per element of the gradients autograd writes."""
        return param_bytes

    def state_element(self, element: int) -> int:
        """Bytes per element of the optimizer's states (ZeRO steps an fp32 master)."""
        return element

    def optimizer_on_host(self) -> bool:
        """True when the optimizer steps on the CPU (CPU offload): no state or step temporary
        on the GPU."""
        return False

    def host_bytes(self) -> int:
        """CPU memory the strategy's offload keeps per rank, beside the optimizer's states."""
        return 0

    def optimizer_enter(self, builder: StepBuilder, run: RunTensors) -> list[int]:
        """What the step allocates before the optimizer's own step and frees after it."""
        return []

    # Points of the step (the walk's own gradients and buffers stay as they are).
    def forward_enter(self, builder: StepBuilder, group: str) -> None: ...
    def forward_exit(self, builder: StepBuilder, group: str) -> None: ...
    def forward_end(self, builder: StepBuilder) -> None: ...
    def backward_enter(self, builder: StepBuilder, group: str) -> None: ...
    def backward_exit(
        self, builder: StepBuilder, group: str, run: RunTensors, sync: bool
    ) -> None: ...
    def backward_end(self, builder: StepBuilder, run: RunTensors, sync: bool) -> None: ...

    def owns_gradients(self) -> bool:
        """True when the strategy makes the gradients itself (gradients() below) instead of the
        walk's byte lists."""
        return False

    def gradients(
        self, builder: StepBuilder, group: str, part: str, run: RunTensors, accumulating: bool
    ) -> None: ...


class Ddp(OneGpu):
    """DistributedDataParallel with torch's defaults (gradient_as_bucket_view off): the
    reducer allocates one flat bucket of every trainable gradient at construction, rebuilds
    it into 25 MiB buckets at the second step's forward (freeing the first), and keeps them;
    autograd's gradients are separate tensors, copied into the buckets and back."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup) -> None:
        super().__init__(spec, setup)
        self._gradient_bytes: list[int] = []

    def prepare(self, builder: StepBuilder, param_bytes: int, trainable: list[int]) -> list[int]:
        element = FP32 if self.setup.lora_rank else param_bytes
        self._gradient_bytes = [n * element for n in trainable]
        builder.at("start", "DDP's gradient buckets")
        return [builder.alloc("gradient_buckets", sum(self._gradient_bytes))]

    def step_start(self, builder: StepBuilder, step: int, buffers: list[int]) -> list[int]:
        """The second step's forward rebuilds the buckets in the order gradients came."""
        if step != 1:
            return buffers
        builder.at("forward", "DDP rebuilds its buckets")
        builder.free_all(buffers)
        return builder.alloc_all("gradient_buckets", self.bucket_sizes(self._gradient_bytes))

    def bucket_sizes(self, tensor_bytes: list[int]) -> list[int]:
        """25 MiB buckets (the first 1 MiB) over the gradients in the order they are ready
        (reverse registration)."""
        buckets, current, cap = [], 0, DDP_FIRST_BUCKET
        for nbytes in reversed(tensor_bytes):
            current += nbytes
            if current >= cap:
                buckets.append(current)
                current, cap = 0, DDP_BUCKET
        return buckets + ([current] if current else [])


@dataclass
class _Live:
    """What one FSDP2 group holds between points: its gathered weights, the all-gather output
    waiting for the next group's copy-out, its unsharded gradients (by the index of their
    parameter among the group's trainable ones)."""

    gathered: list[int] = field(default_factory=list)
    prefetched: int | None = None
    gradients: dict[int, int] = field(default_factory=dict)


class Fsdp2(OneGpu):
    """fully_shard per group (model_groups), N ranks, rank 0's view (docs/distributed.md)."""

    builds_whole_model = False

    def __init__(self, spec: ModelSpec, setup: TrainSetup) -> None:
        super().__init__(spec, setup)
        self.ranks = setup.gpus
        self.groups = model_groups(spec, setup)
        self.layers = spec.num_hidden_layers
        # CPUOffloadPolicy: shards, their gradients and the optimizer on the CPU (pinned)
        self.offload = setup.cpu_offload
        self._live: dict[str, _Live] = {}
        self._held_gather: int | None = None  # the last forward all-gather output
        self._held_reduce: int | None = None  # the last reduce-scatter input
        self._pending: list[str] = []  # groups whose post-backward waits for the final callback
        self._order: tuple[str, ...] | None = None
        self._position: dict[str, int] = {}

    # ------------------------------------------------------------------ sizes
    def _group(self, name: str) -> Group:
        return self.groups["layer" if name.startswith("layer") else name]

    def forward_order(self) -> tuple[str, ...]:
        # made once: the walk asks for it per layer, and a deep model's list is long
        if self._order is None:
            names = ["embedding"] if "embedding" in self.groups else []
            self._order = (*names, *(f"layer {i}" for i in range(self.layers)), "tail")
            self._position = {name: i for i, name in enumerate(self._order)}
        return self._order

    def sharded(self, name: str) -> list[int]:
        return [p.shard(self.ranks) * p.stored for p in self._group(name).params]

    def weight_tensors(
        self, elements: list[int], adapters: list[int], param_bytes: int
    ) -> list[int]:
        """Rank 0's padded shard of every parameter, group by group in forward order (none on
        the GPU under offload)."""
        if self.offload:
            return []
        return [n for name in self.forward_order() for n in self.sharded(name)]

    def local_trainable(self, trainable: list[int]) -> list[int]:
        return [
            p.shard(self.ranks)
            for name in self.forward_order()
            for p in self._group(name).trainable
        ]

    def gradient_bytes(self, param_bytes: int) -> int:
        return self.groups["tail"].params[0].computed

    def owns_gradients(self) -> bool:
        return True

    def optimizer_on_host(self) -> bool:
        return self.offload

    def host_bytes(self) -> int:
        """Under offload: rank 0's shards and their sharded gradients, in the stored dtype."""
        if not self.offload:
            return 0
        order = self.forward_order()
        shards = sum(n for name in order for n in self.sharded(name))
        grads = sum(p.shard(self.ranks) * p.stored for n in order for p in self._group(n).trainable)
        return shards + grads

    # ------------------------------------------------------------------ collectives
    def _gather(self, builder: StepBuilder, name: str) -> int:
        """foreach_all_gather: the copy-in of the shards cast to the compute dtype (where it
        differs), the all-gather output (N shards), the copy-in freed."""
        group = self._group(name)
        if self.offload:
            copy_ins = self._offloaded_copy_ins(builder, group)
        else:
            casting = any(p.computed != p.stored for p in group.params)
            total = sum(p.shard(self.ranks) * p.computed for p in group.params)
            copy_in = total if casting else 0
            copy_ins = [builder.alloc("all_gather_buffers", copy_in, ALL_GATHER_STREAM)]
        output = builder.alloc(
            "all_gather_buffers",
            sum(self.ranks * p.shard(self.ranks) * p.computed for p in group.params),
            ALL_GATHER_STREAM,
        )
        builder.free_all(reversed(copy_ins))  # a list's items go last to first
        return output

    def _offloaded_copy_ins(self, builder: StepBuilder, group: Group) -> list[int]:
        """FSDPParam.all_gather_inputs under offload, per parameter: its CPU shard copied to the
        GPU in the stored dtype, then cast to the compute dtype where it differs (the copy freed
        at once); all held until the all-gather output has them."""
        inputs = []
        for p in group.params:
            shard = p.shard(self.ranks)
            copy = builder.alloc("all_gather_buffers", shard * p.stored, ALL_GATHER_STREAM)
            if p.computed != p.stored:
                cast = builder.alloc("all_gather_buffers", shard * p.computed, ALL_GATHER_STREAM)
                builder.free(copy)
                copy = cast
            inputs.append(copy)
        return inputs

    def _copy_out(self, builder: StepBuilder, name: str) -> list[int]:
        """The gathered weights, one padded tensor (N shards) per parameter."""
        return builder.alloc_all(
            "gathered_weights",
            (self.ranks * p.shard(self.ranks) * p.computed for p in self._group(name).params),
        )

    # ------------------------------------------------------------------ forward
    def forward_enter(self, builder: StepBuilder, group: str) -> None:
        live = self._live.setdefault(group, _Live())
        if live.gathered:  # kept from an earlier point (the tied tail, at the embedding)
            return
        output = self._gather(builder, group)
        live.gathered = self._copy_out(builder, group)
        builder.free(self._held_gather)  # the previous group's, held until this copy-out
        self._held_gather = output

    def forward_exit(self, builder: StepBuilder, group: str) -> None:
        if self._group(group).reshard_after_forward:
            live = self._live[group]
            builder.free_all(live.gathered)
            live.gathered = []

    def forward_end(self, builder: StepBuilder) -> None:
        """The root's post-forward, after the loss: the last all-gather output goes."""
        builder.free(self._held_gather)
        self._held_gather = None

    # ------------------------------------------------------------------ backward
    def backward_enter(self, builder: StepBuilder, group: str) -> None:
        live = self._live.setdefault(group, _Live())
        if not live.gathered:
            output = live.prefetched or self._gather(builder, group)
            live.prefetched = None
            live.gathered = self._copy_out(builder, group)
            builder.free(output)
        order = self.forward_order()
        index = self._position[group]
        if index > 0:  # prefetch the group that ran before this one in forward
            previous = order[index - 1]
            before = self._live.setdefault(previous, _Live())
            if not before.gathered and before.prefetched is None:
                before.prefetched = self._gather(builder, previous)

    def gradients(
        self, builder: StepBuilder, group: str, part: str, run: RunTensors, accumulating: bool
    ) -> None:
        """Autograd's gradients of the part's trainable parameters, unpadded, in the compute
        dtype; a later micro-batch adds each into the one kept and frees it."""
        live = self._live.setdefault(group, _Live())
        for index, param in enumerate(self._group(group).trainable):
            if param.part != part:
                continue
            tensor = builder.alloc("unsharded_gradients", param.numel * param.computed)
            if accumulating:
                builder.free(tensor)
            else:
                live.gradients[index] = tensor

    def adopt_gradient(self, builder: StepBuilder, group: str, part: str, tensor: int) -> None:
        """A gradient computed before backward (FLCE's dW), handed to autograd as it is."""
        trainable = self._group(group).trainable
        index = next(i for i, p in enumerate(trainable) if p.part == part)
        live = self._live.setdefault(group, _Live())
        live.gradients[index] = builder.retag(tensor, "unsharded_gradients")

    def backward_exit(self, builder: StepBuilder, group: str, run: RunTensors, sync: bool) -> None:
        """post_backward: the gathered weights go; when syncing, the gradients are copied into
        one reduce-scatter input (N shards, held until the next group's post-backward), freed,
        and reduced into a flat shard in the compute dtype, cast to the stored dtype where it
        differs: the sharded gradients, kept until zero_grad. Groups whose forward inputs need
        no gradient (the untied embedding, the tied tail) wait for the final callback."""
        if group == "embedding" or (group == "tail" and "embedding" not in self.groups):
            if group not in self._pending:
                self._pending.append(group)
            return
        self._post_backward(builder, group, run, sync)

    def _post_backward(self, builder: StepBuilder, group: str, run: RunTensors, sync: bool) -> None:
        live = self._live.setdefault(group, _Live())
        builder.free_all(live.gathered)
        live.gathered = []
        trainable = self._group(group).trainable
        if not sync or not live.gradients:
            return  # no-sync accumulation keeps the unsharded gradients
        builder.free(self._held_reduce)
        reduce_input = builder.alloc(
            "reduce_scatter_buffers",
            sum(self.ranks * p.shard(self.ranks) * p.computed for p in trainable),
        )
        # foreach_reduce frees them in reverse order, but for the last parameter's, which its
        # loop variable holds until it returns
        order = sorted(live.gradients)
        last = live.gradients[order[-1]]
        builder.free_all(live.gradients[i] for i in reversed(order[:-1]))
        shard_elements = sum(p.shard(self.ranks) for p in trainable)
        computed, stored = trainable[0].computed, trainable[0].stored
        # under offload a reduce-scatter output that is cast is only a buffer: the cast is
        # the gradient the host gets
        category = "reduce_scatter_buffers" if self.offload and stored != computed else "gradients"
        output = builder.alloc(category, shard_elements * computed, REDUCE_SCATTER_STREAM)
        if stored != computed:
            cast = builder.alloc("gradients", shard_elements * stored, REDUCE_SCATTER_STREAM)
            builder.free(output)
            output = cast
        if self.offload:  # copied to the host per parameter; foreach_reduce drops the GPU one
            builder.mark("backward", f"{group} gradients to the host")
            builder.free(output)
        elif run.gradients_by_group.get(group) is not None:  # accumulated in place
            builder.free(output)
        else:
            run.gradients_by_group[group] = output
            run.gradients.append(output)
        builder.free(last)
        live.gradients = {}
        self._held_reduce = reduce_input

    def backward_end(self, builder: StepBuilder, run: RunTensors, sync: bool) -> None:
        """The root's final callback: the post-backward of the groups that waited for it, in
        module order, then the last reduce-scatter input goes."""
        for group in list(self._pending):
            self._post_backward(builder, group, run, sync)
        self._pending = []
        for live in self._live.values():  # a prefetch nothing copied out (a frozen embedding)
            builder.free(live.prefetched)
            live.prefetched = None
        if sync:
            builder.free(self._held_reduce)
            self._held_reduce = None


def computed_setup(setup: TrainSetup) -> TrainSetup:
    """The setup as its step computes: under amp-*, FSDP2's mixed-precision policy (accelerate
    sets param_dtype to the autocast dtype) gathers the weights in that dtype, and DeepSpeed's
    bf16 mode casts them, so the activations are those of a bf16 model; DDP and one GPU
    compute as set (fp32 weights under autocast)."""
    if setup.strategy in SHARDING_STRATEGIES and setup.precision.startswith("amp"):
        return setup.model_copy(update={"precision": "bf16"})
    return setup


def strategies_modelled(spec: ModelSpec) -> bool:
    """Whether data parallelism is modelled for this architecture: not where layers differ (a MoE
    model's dense layers, Gemma 4's global layers), since each strategy's walk shards one layer's
    parameters for all, nor through a DeepSeek-style fp32 router, whose casts the sharded bf16
    weights change, nor for Llama 4's every-expert MoE, whose backward the walk follows
    allocation by allocation with one GPU's gradients."""
    moe = FAMILIES[spec.model_type].config.moe if spec.model_type in FAMILIES else None
    uniform = spec.uniform_layers and not spec.dense_layers
    return uniform and (moe is None or moe.router not in ("sigmoid_fp32", "sigmoid_every_expert"))


def layout_for(spec: ModelSpec, setup: TrainSetup) -> OneGpu:
    if setup.strategy is not None and not spec.uniform_layers:
        raise UsageError(
            f"{spec.model_type}'s layers of two attention geometries are modelled on one GPU "
            f"only, not under {setup.strategy}"
        )
    if setup.strategy is not None and not strategies_modelled(spec):
        raise UsageError(
            f"{spec.model_type} is estimated on one GPU only: data parallelism ({setup.strategy}) "
            "is not modelled for its MoE layers (dense layers beside them, an fp32 router, or "
            "every token through every expert)"
        )
    if setup.strategy == "fsdp2":
        return Fsdp2(spec, setup)
    if setup.strategy == "ddp":
        return Ddp(spec, setup)
    if setup.strategy is not None:
        from memplan.estimators.zero import Zero

        return Zero(spec, setup)
    return OneGpu(spec, setup)
