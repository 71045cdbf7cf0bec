"""DeepSpeed ZeRO stages 1-3 (DeepSpeed 0.19) as accelerate configures them with the Hugging Face
"auto" sizes, rank 0's view: predicted from DeepSpeed's code, measured on two H100s
(docs/distributed.md, which says what is left out).

Under DeepSpeed's bf16 mode (accelerate's mixed precision bf16, or a bf16 model) the weights
and their gradients are bf16 and the optimizer steps an fp32 master copy of rank 0's partition;
with fp32 everything is fp32 (stage 3 then steps the partition itself). The reduce bucket is
hidden_size**2 elements (the "auto" value), doubled by overlap_comm, which DeepSpeed turns on
for stage 3 only.

Stage 3's gathered weights. Step 1 records the module trace: each module's parameters are
gathered at its forward (or backward) and released after it. From step 2 on, each module's fetch
also prefetches the next 0.9 * hidden_size**2 elements of the trace that are not gathered; as a
decoder layer makes more fetches (containers, persistent norms) than it has prefetch units, the
prefetcher runs ahead until stage3_max_live_parameters (1e9 elements) are gathered, then holds
that many: the parameters next used in the trace, through the end of forward and into backward,
until fewer than that are left to use. Seen on two gloo ranks (llama, 16 layers, the thresholds
scaled with the model) and on two H100s (llama-3.2-1b: 1.89 GiB gathered at the loss backward).

CPU offload as accelerate configures it (offload_optimizer_device cpu, and offload_param_device
cpu at stage 3): the fp32 partition, its gradient and AdamW's states live in pinned CPU memory
and DeepSpeedCPUAdam steps them there; stages 1-2 keep a GPU staging buffer of the largest
parameter's gradient (temp_grad_buffer_for_gpu_offload) and cast each partition slice to fp32
on the GPU before its copy to the host; stage 3 keeps its bf16 partitions on the CPU too and
gathers them to the GPU as without offload. Left out: the partitions' copies to the GPU before
each stage 3 gather (1/N of a group's elements) and the per-parameter norms (scalars)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.estimators.contracts import FP32
from memplan.estimators.parallel import OneGpu, model_groups
from memplan.schema import ModelSpec, TrainSetup

if TYPE_CHECKING:  # the walk imports this module
    from memplan.estimators.timeline import RunTensors, StepBuilder

MAX_REUSE_DISTANCE = 10**9
# stage3_max_live_parameters: the prefetcher stops adding parameters once this many are gathered
MAX_LIVE_PARAMETERS = 10**9
# stage3_param_persistence_threshold as accelerate's "auto" sets it, per hidden element: smaller
# parameters (norms, biases) stay gathered, outside the prefetcher's count
PERSISTENCE_PER_HIDDEN = 10
# DeepSpeed computes the gradient norm per partition slice in fp64.
NORM_BYTES = 8


class Zero(OneGpu):
    # the model as built before DeepSpeed takes it is not walked
    builds_whole_model = False

    def __init__(self, spec: ModelSpec, setup: TrainSetup) -> None:
        super().__init__(spec, setup)
        assert setup.strategy is not None
        self.stage = int(setup.strategy[-1])
        self.ranks = setup.gpus
        self.element = FP32 if setup.precision == "fp32" else 2  # bf16 mode otherwise
        self.offload = setup.cpu_offload
        self.groups = model_groups(spec, setup)
        self.layers = spec.num_hidden_layers
        self.numel = {
            name: sum(p.numel for p in group.params) if group else 0
            for name, group in (
                (name, self.groups.get(name)) for name in ("embedding", "layer", "tail")
            )
        }
        self.trainable = (
            self._trainable("embedding")
            + self._trainable("layer") * self.layers
            + self._trainable("tail")
        )
        self.total = self.numel["embedding"] + self.numel["layer"] * self.layers
        self.total += self.numel["tail"]
        # rank 0's partition of the trainable elements (stage 1/2 pad to 2N, stage 3 each
        # parameter to N)
        self.partition = -(-self.trainable // (2 * self.ranks)) * 2
        self.bucket = spec.hidden_size**2
        self.overlap = self.stage == 3
        self._grads: list[int] = []
        self._ipg: list[int] = []
        self._gathered: dict[tuple[str, int], int] = {}  # (group, parameter index) -> tensor
        self._held: list[tuple[tuple[str, int], int]] | None = None  # the list _hold last held
        self._param_lists: dict[str, list[tuple[tuple[str, int], int]]] = {}
        self._windows: dict[str | None, list[tuple[tuple[str, int], int]]] = {}
        self.persistence = PERSISTENCE_PER_HIDDEN * spec.hidden_size

    def _trainable(self, name: str) -> int:
        group = self.groups.get(name)
        return sum(p.numel for p in group.trainable) if group else 0

    def _name(self, group: str) -> str:
        return "layer" if group.startswith("layer") else group

    # ------------------------------------------------------------------ build
    def weight_tensors(
        self, elements: list[int], adapters: list[int], param_bytes: int
    ) -> list[int]:
        if self.stage < 3:  # every rank keeps the whole model (a flat copy of the trained part)
            return [n * self.element for n in elements + adapters]
        if self.offload:  # offload_param: the partitions stay on the CPU
            return []
        # partitions, defragmented into one buffer
        return [-(-(self.total + sum(adapters)) // self.ranks) * self.element]

    def prepare(self, builder: StepBuilder, param_bytes: int, trainable: list[int]) -> list[int]:
        builder.at("start", "ZeRO partitions")
        if self.offload:
            if self.stage == 3:
                return [builder.alloc("reduce_scatter_buffers", self.bucket * self.element)]
            # the GPU staging buffer of the largest parameter's gradient
            return [builder.alloc("gradients", self._largest() * self.element)]
        kept = []
        if self.stage < 3 or self.element != FP32:  # the fp32 master of rank 0's partition
            kept.append(builder.alloc("optimizer_states", self.partition * FP32))
        if self.stage == 3:
            kept.append(builder.alloc("gradients", self.partition * self.element))
            kept.append(builder.alloc("reduce_scatter_buffers", self.bucket * self.element))
        return kept

    def local_trainable(self, trainable: list[int]) -> list[int]:
        return [self.partition]

    def state_element(self, element: int) -> int:
        return FP32

    def optimizer_on_host(self) -> bool:
        return self.offload

    def host_bytes(self) -> int:
        """Under offload, read off DeepSpeed's code (not measured): the fp32 partition and its
        fp32 gradient; stages 1-2 a low-precision copy of the partition and a staging buffer of
        the largest parameter; stage 3 its low-precision partitions and their gradients."""
        if not self.offload:
            return 0
        fp32 = 2 * self.partition * FP32
        if self.stage < 3:
            return fp32 + (self.partition + self._largest()) * self.element
        master = fp32 if self.element != FP32 else self.partition * FP32  # fp32: the partition
        params = -(-self.total // self.ranks) * self.element
        return master + params + self.partition * self.element

    def _largest(self) -> int:
        """Elements of the largest trainable parameter."""
        return max((p.numel for g in self.groups.values() for p in g.trainable), default=0)

    def gradient_bytes(self, param_bytes: int) -> int:
        return self.element

    def owns_gradients(self) -> bool:
        return True

    # ------------------------------------------------------------------ gathers (stage 3)
    def _params(self, group: str) -> list[tuple[tuple[str, int], int]]:
        """(key, elements) of the group's gathered parameters (persistent ones excluded), in
        backward order (a layer's MLP before its attention); made once a group (every window
        walks the groups after its own)."""
        cached = self._param_lists.get(group)
        if cached is None:
            name = self._name(group)
            found = self.groups.get(name)
            params = list(found.params) if found else []
            cached = self._param_lists[group] = [
                ((group, i), p.numel)
                for i, p in reversed(list(enumerate(params)))
                if p.numel > self.persistence
            ]
        return cached

    def _backward_order(self, group: str | None) -> list[str]:
        """The groups backward uses from `group` on (None: all of them), in order; the tied
        embedding (the tail) is used again last, by the embedding's backward."""
        order = ["tail"] + [f"layer {i}" for i in reversed(range(self.layers))]
        order.append("embedding" if "embedding" in self.groups else "tail")
        return order if group is None else order[order.index(group) :]

    def _window(self, group: str | None) -> list[tuple[tuple[str, int], int]]:
        """The parameters next used from `group`'s backward on, distinct, until the prefetcher's
        count reaches MAX_LIVE_PARAMETERS (the one that crosses it included); computed once a
        group (every layer asks: a deep small model would walk all the others each time)."""
        cached = self._windows.get(group)
        if cached is None:
            cached = self._windows[group] = self._walk_window(group)
        return cached

    def _walk_window(self, group: str | None) -> list[tuple[tuple[str, int], int]]:
        window: list[tuple[tuple[str, int], int]] = []
        seen: set[tuple[str, int]] = set()
        count = 0
        for name in self._backward_order(group):
            for key, numel in self._params(name):
                if count >= MAX_LIVE_PARAMETERS:
                    return window
                if key not in seen:
                    seen.add(key)
                    window.append((key, numel))
                    count += numel
        return window

    def _hold(self, builder: StepBuilder, wanted: list[tuple[tuple[str, int], int]]) -> None:
        """Gathers exactly `wanted`: frees the others, allocates the missing ones in order."""
        if self.stage < 3 or self.ranks == 1 or wanted is self._held:
            return  # the same (cached) list held again: nothing to do
        self._held = wanted
        keys = {key for key, _ in wanted}
        builder.free_all([self._gathered.pop(k) for k in list(self._gathered) if k not in keys])
        for key, numel in wanted:
            if key not in self._gathered:
                padded = -(-numel // self.ranks) * self.ranks
                self._gathered[key] = builder.alloc("gathered_weights", padded * self.element)

    def forward_enter(self, builder: StepBuilder, group: str) -> None:
        # step 1 holds the module it runs; later steps the prefetcher's window
        self._hold(builder, self._window(None) if self.steady else self._params(group))

    def forward_exit(self, builder: StepBuilder, group: str) -> None:
        if not self.steady:
            self._hold(builder, [])

    def forward_end(self, builder: StepBuilder) -> None:
        if not self.steady:  # lm_head's weight, released after its forward
            self._hold(builder, [])

    def backward_enter(self, builder: StepBuilder, group: str) -> None:
        self._hold(builder, self._window(group) if self.steady else self._params(group))
        if not self._ipg and self.stage < 3:  # the reduce bucket, at the first gradient
            self._ipg = builder.alloc_all(
                "reduce_scatter_buffers", [self.bucket * self.element] * (1 + self.overlap)
            )

    # ------------------------------------------------------------------ gradients
    def gradients(
        self, builder: StepBuilder, group: str, part: str, run: RunTensors, accumulating: bool
    ) -> None:
        params = [p for p in self.groups[self._name(group)].trainable if p.part == part]
        sizes = [p.numel * self.element for p in params]
        if self.stage == 1:  # autograd's gradients stay until the end of backward
            self._grads += builder.alloc_all("unsharded_gradients", sizes)
            return
        # copied into the reduce bucket and freed; stage 3 reduce-scatters through a
        # concatenated copy of the bucket
        held = builder.alloc_all("unsharded_gradients", sizes)
        if self.stage == 3:
            held += builder.alloc_all(
                "reduce_scatter_buffers", [min(sum(sizes), self.bucket * self.element)]
            )
        builder.mark("backward", f"{group} backward", self._to_host(sum(p.numel for p in params)))
        builder.free_all(held)
        if self.offload:  # the partition's gradient goes to the host
            return
        if self.stage == 2 and not run.gradients and self._reaches_partition(group):
            run.gradients.append(builder.alloc("gradients", self.partition * self.element))

    def adopt_gradient(self, builder: StepBuilder, group: str, part: str, tensor: int) -> None:
        builder.retag(tensor, "unsharded_gradients")
        if self.stage == 1:
            self._grads.append(tensor)
        else:
            builder.free(tensor)

    def _to_host(self, elements: int) -> list[int]:
        """Under offload at stages 1-2, the fp32 cast of a partition slice of `elements` (at
        most one parameter's) made on the GPU before its copy to the host."""
        if not self.offload or self.stage == 3 or self.element == FP32:
            return []
        return [min(elements, self._largest(), self.partition) * FP32]

    def _reaches_partition(self, group: str) -> bool:
        """Whether this group holds rank 0's first partition element's gradient owners: the
        partition covers the first parameters in registration order (the embedding, then the
        first layers)."""
        if group == "tail":
            return "embedding" not in self.groups  # the tied embedding is the lm_head
        if group == "embedding":
            return True
        index = int(group.split()[-1])
        before = self._trainable("embedding") + index * self._trainable("layer")
        return before < self.partition

    def backward_exit(self, builder: StepBuilder, group: str, run: RunTensors, sync: bool) -> None:
        if not self.steady:
            self._hold(builder, [])
            return
        order = self._backward_order(group)
        self._hold(builder, self._window(order[1]) if len(order) > 1 else [])

    def backward_end(self, builder: StepBuilder, run: RunTensors, sync: bool) -> None:
        if self.stage == 1 and self.offload:  # reduced through the bucket to the host
            builder.mark("backward", "ZeRO-1 reduces the gradients", self._to_host(self.partition))
            builder.free_all(self._grads)
            self._grads = []
        elif self.stage == 1:  # reduced into rank 0's partition at the end of backward
            run.gradients.append(builder.alloc("gradients", self.partition * self.element))
            builder.mark("backward", "ZeRO-1 reduces the gradients")
            builder.free_all(self._grads)
            self._grads = []
        elif self.stage == 2 and not run.gradients and not self.offload:
            run.gradients.append(builder.alloc("gradients", self.partition * self.element))
        builder.free_all(self._ipg)
        self._ipg = []
        self._hold(builder, [])

    def optimizer_enter(self, builder: StepBuilder, run: RunTensors) -> list[int]:
        """The step's own temporaries before the optimizer's: the fp64 norm of the largest
        partition slice, then the fp32 copy of the flat partition gradient (kept through the
        optimizer's step) once the low-precision one is freed; under offload both are the
        host's."""
        if self.offload:
            return []
        largest = self._largest()
        builder.mark("optimizer", "gradient norm", [min(largest, self.partition) * NORM_BYTES])
        fp32 = builder.alloc("transient", self.partition * FP32)
        builder.mark("optimizer", "fp32 gradient partition")
        if self.stage < 3:
            builder.free_all(run.gradients)
            run.gradients = []
        return [fp32]
