"""Pydantic models shared by every layer: what a model is, how it is trained, what is predicted,
what is planned and what is measured. Imports neither torch nor transformers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    model_validator,
)

from memplan.errors import UsageError

Precision = Literal["bf16", "amp-bf16", "amp-fp16", "fp32"]
Attention = Literal["sdpa", "eager"]
Optimizer = Literal[
    "adamw", "adamw-fused", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor"
]
# Data parallelism as accelerate runs it: DDP, FSDP2 (fully_shard), DeepSpeed ZeRO stages.
Strategy = Literal["ddp", "fsdp2", "zero1", "zero2", "zero3"]
# How the estimate counts a multimodal config's vision tower and projector: frozen (weights),
# trained (weights, gradients and optimizer states), or not at all (None).
VisionTower = Literal["frozen", "trained"]
# Who runs a gated DeltaNet layer's chunked delta rule: transformers' torch fallback
# (torch_chunk_gated_delta_rule) or flash-linear-attention's Triton kernels, which transformers
# takes where the `fla` package imports.
DeltaNetKernels = Literal["torch", "fla"]
# Who runs a gated DeltaNet layer's causal depthwise conv: torch (F.conv1d, then SiLU) or
# causal-conv1d's CUDA kernel (SiLU fused), which transformers takes where it imports.
DeltaNetConv = Literal["torch", "causal_conv1d"]
STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
# Those that shard weights, gradients or optimizer states (and can offload them to the CPU).
SHARDING_STRATEGIES: tuple[str, ...] = ("fsdp2", "zero1", "zero2", "zero3")

# Canonical kernel names, in the order the advisor reports them.
KERNEL_NAMES: tuple[str, ...] = (
    "rms_norm",
    "layer_norm",
    "rope",
    "sink_attention",
    "swiglu",
    "geglu",
    "cross_entropy",
    "flce",
    "embedding",
)

GIB = 2**30

# The GLU kernel that computes act(gate) * up exactly, by the config's activation name. The
# original Gemma configs say "gelu", which transformers 5.17 builds as exact (erf) GELU; the
# patch checks which GELU the module really computes (patching.engine._gelu_approximation).
GLU_KERNEL_BY_ACTIVATION: dict[str, str] = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "gelu": "geglu",  # exact (erf) GELU: the kernel's approximate="none"
}
# F.gelu's approximate argument for each GELU activation name (transformers' ACT2FN).
GELU_APPROXIMATION: dict[str, str] = {
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu": "none",
}


class ModelSpec(BaseModel):
    """The numbers of a causal LM that decide its memory; built from a Hugging Face config."""

    model_config = ConfigDict(frozen=True)

    name: str | None = None
    model_type: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(ge=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    # transformers builds a KV cache in training too when this is on (and checkpointing off).
    use_cache: bool = True
    hidden_act: str = "silu"
    norm: Literal["rms", "layer"] = "rms"
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # What q_norm / k_norm normalize: each head's vector, or the whole projection output (OLMo).
    qk_norm_scope: Literal["head", "projection"] = "head"
    # Gemma 2/3 add a norm before and after both attention and MLP.
    sandwich_norm: bool = False
    # OLMo 2/3: norms only on the attention and MLP outputs, none before them.
    post_norm: bool = False
    # OLMo 2/3: fp32 cos/sin; q and k rotated in fp32 and cast back to their dtype.
    rope_in_fp32: bool = False
    # The cos/sin pairs the model computes per forward (one per attention layer type in OLMo 3).
    rope_tables: int = Field(default=1, gt=0)
    # The leading dims of each head that RoPE rotates (GLM-4.5's partial_rotary_factor); None:
    # all of head_dim.
    rotary_dim: int | None = Field(default=None, gt=0)
    # DeepSeek-V3's multi-head latent attention (MLA): q from q_proj, or through a q_lora_rank
    # wide q_a_proj, q_a_layernorm and q_b_proj; k and v from kv_a_proj_with_mqa's
    # kv_lora_rank wide latent (after kv_a_layernorm) through kv_b_proj, beside one shared
    # rotated key of rotary_dim; head_dim is q's and k's (qk_nope + qk_rope), v_head_dim v's.
    # kv_lora_rank 0: not MLA; q_lora_rank 0: q_proj.
    kv_lora_rank: int = Field(default=0, ge=0)
    q_lora_rank: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)
    # gpt-oss: cos/sin head_dim / 2 wide, applied to both halves of each head.
    rope_half_tables: bool = False
    # gpt-oss: a learned sink logit per attention head, concatenated to the scores (eager).
    attention_sinks: bool = False
    fused_qkv: bool = False  # phi3: one qkv_proj
    fused_gate_up: bool = False  # phi3: one gate_up_proj
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Ministral 3: the queries times Llama 4's position-dependent factor after RoPE.
    llama4_query_scale: bool = False
    # Llama 4: q and k rotated as fp32 complex numbers by one complex64 table (cos + i sin)
    # per forward and cast back to their dtype; in the layers that rotate, L2-normalized after
    # RoPE (no weight) where qk_l2_norm, and attending within chunks of attention_chunk_size
    # positions through a mask; the queries of the others times a position-dependent
    # temperature where nope_query_temperature. eager_softmax_fp32: eager attention's softmax
    # in fp32 (Llama's), or in q's dtype (Llama 4's).
    rope_complex: bool = False
    qk_l2_norm: bool = False
    nope_query_temperature: bool = False
    attention_chunk_size: int | None = Field(default=None, gt=0)
    eager_softmax_fp32: bool = True
    # Dropout probabilities in training: on the attention probabilities, and on the attention
    # and MLP outputs before their residual adds (seed_oss).
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    residual_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    sliding_window: int | None = Field(default=None, gt=0)
    layer_types: tuple[str, ...] | None = None
    # Layers that apply no RoPE to q and k (SmolLM3's NoPE layers), by index.
    nope_layers: tuple[int, ...] = ()
    # Gemma 4: the full-attention layers, by index, take their own head dim and KV heads, and
    # with values_from_keys there no v_proj: v is k_proj's output (attention_k_eq_v).
    global_layers: tuple[int, ...] = ()
    global_head_dim: int | None = Field(default=None, gt=0)
    global_key_value_heads: int | None = Field(default=None, gt=0)
    global_values_from_keys: bool = False
    # This layer's v is k_proj's output (a view of one layer: ModelSpec.layer).
    values_from_keys: bool = False
    # Gemma 4: a scale-free RMSNorm on v (v_norm) beside q_norm and k_norm.
    v_norm: bool = False
    # Gemma 4: each layer multiplies its output in place by a 1-element buffer, which the
    # product keeps for backward.
    layer_scalar: bool = False
    # Gemma 4: these layers (the last of each attention type) keep their k and v in the
    # model's shared_kv_states until the forward returns, and under checkpointing until the
    # end of backward (by then their recomputation's).
    kv_kept_layers: tuple[int, ...] = ()
    # Granite's multipliers: of the embedding, of each attention and MLP output before its
    # residual add, and the divisor of the logits; None where the family has none.
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = Field(default=None, gt=0)
    # Mixture of experts (mixtral, qwen3_moe, glm4_moe); 0 means dense.
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int = Field(default=0, ge=0)
    # The layers of a MoE model whose MLP is dense (intermediate_size wide), by index: GLM-4.5's
    # first_k_dense_replace leading layers.
    dense_layers: tuple[int, ...] = ()
    # How tokens reach the experts (memplan.families.MoeRules.router).
    moe_router: Literal["softmax", "topk_softmax", "sigmoid_fp32", "sigmoid_every_expert"] = (
        "softmax"
    )
    # The width of the shared experts' gated MLP beside the routed experts of each MoE layer
    # (moe_intermediate_size x n_shared_experts; Llama 4's one shared expert); 0: none.
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    # Qwen3.5's gated DeltaNet layers, by index (the others are full attention): transformers'
    # torch fallback (torch_chunk_gated_delta_rule, the causal conv1d in torch), with
    # linear_* heads and dims and a depthwise conv of linear_conv_kernel_dim taps; `deltanet`:
    # this layer view is one of them (ModelSpec.layer).
    linear_attention_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = Field(default=0, ge=0)
    linear_num_value_heads: int = Field(default=0, ge=0)
    linear_key_head_dim: int = Field(default=0, ge=0)
    linear_value_head_dim: int = Field(default=0, ge=0)
    linear_conv_kernel_dim: int = Field(default=0, ge=0)
    deltanet: bool = False
    # Qwen3.5's full attention: q_proj twice as wide, its second half a gate whose sigmoid
    # multiplies the attention output before o_proj.
    attention_output_gate: bool = False
    # Qwen3.5's multimodal RoPE: cos/sin built for every batch row (batch x seq x rotated).
    rope_per_batch_row: bool = False
    # A multimodal config (gemma3, mistral3) read for its text model: its model_type, and the
    # elements of each parameter of its vision tower and projector, in registration order
    # (memplan.catalog.vision_tower), which the estimate counts only when asked
    # (TrainSetup.count_vision_tower).
    wrapper_model_type: str | None = None
    vision_tower_tensors: tuple[int, ...] = Field(default=(), repr=False)
    # The config.json it came from, so verify can build the real model.
    hf_config: dict[str, Any] = Field(default_factory=dict, repr=False)

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts})"
            )
        if any(n <= 0 for n in self.vision_tower_tensors):
            raise ValueError("every vision tower tensor has at least one element")
        if any(not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {self.nope_layers} name layers the model does not have")
        if any(not 0 <= i < self.num_hidden_layers for i in self.dense_layers):
            raise ValueError(
                f"dense_layers {self.dense_layers} name layers the model does not have"
            )
        if self.rotary_dim is not None and self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) exceeds head_dim ({self.head_dim})")
        if self.kv_lora_rank and not (self.v_head_dim and self.rotary_dim):
            raise ValueError("latent attention (kv_lora_rank) needs v_head_dim and rotary_dim")
        if self.kv_lora_rank and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                "latent attention builds k and v for every head: num_key_value_heads "
                "must equal num_attention_heads"
            )
        if any(not 0 <= i < self.num_hidden_layers for i in self.global_layers):
            raise ValueError(f"global_layers {self.global_layers} name layers the model lacks")
        heads = self.global_key_value_heads
        if heads is not None and self.num_attention_heads % heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"global_key_value_heads ({heads})"
            )
        if any(not 0 <= i < self.num_hidden_layers for i in self.linear_attention_layers):
            raise ValueError(
                f"linear_attention_layers {self.linear_attention_layers} name layers the model "
                "does not have"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        return self

    def moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has a mixture of experts (not a dense MLP)."""
        return self.num_experts > 0 and index not in self.dense_layers

    @property
    def gated_mlps(self) -> bool:
        """Whether some layer runs a gated MLP module: every layer of a dense model; of a MoE
        model its dense layers and its shared experts."""
        shared = self.shared_expert_intermediate_size > 0
        return not self.num_experts or bool(self.dense_layers) or shared

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3's): q, k and v from low-rank latents."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_dim(self) -> int:
        """Of each q and k head, the dims RoPE leaves alone (MLA: qk_nope_head_dim)."""
        return self.head_dim - self.rotated_dim

    @property
    def value_dim(self) -> int:
        """Each value head's width: v_head_dim under MLA, else head_dim."""
        return self.v_head_dim or self.head_dim

    @property
    def rotated_dim(self) -> int:
        """The dims of each head that RoPE rotates (cos and sin are this wide)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def uniform_layers(self) -> bool:
        """Every decoder layer has the same attention geometry (no Gemma 4 global layers)."""
        return not self.global_layers and not self.linear_attention_layers

    def layer(self, index: int) -> ModelSpec:
        """The spec as decoder layer `index` sees it: a global layer's head dim, KV heads and
        values taken from the keys in place of the model's, a gated DeltaNet layer flagged as
        one (the spec itself elsewhere)."""
        if index in self.linear_attention_layers:
            return self.model_copy(update={"deltanet": True, "linear_attention_layers": ()})
        if index not in self.global_layers:
            return self
        return self.model_copy(
            update={
                "head_dim": self.global_head_dim or self.head_dim,
                "num_key_value_heads": self.global_key_value_heads or self.num_key_value_heads,
                "values_from_keys": self.global_values_from_keys,
                "global_layers": (),
            }
        )

    def layers(self) -> list[ModelSpec]:
        """ModelSpec.layer of every decoder layer, in order."""
        return [self.layer(index) for index in range(self.num_hidden_layers)]

    @property
    def vision_tower_params(self) -> int:
        """Parameters of the multimodal config's vision tower and projector (0: none)."""
        return sum(self.vision_tower_tensors)


class TrainSetup(BaseModel):
    """How one training step is run: the options of the measurement protocol."""

    model_config = ConfigDict(frozen=True)

    batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    grad_checkpointing: bool = False
    attn: Attention = "sdpa"
    lora_rank: int | None = Field(default=None, gt=0)
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    grad_accum: int = Field(default=1, gt=0)
    kernels: tuple[str, ...] = ()
    flce_chunk: int | None = Field(default=None, gt=0)
    # Bytes FLCE may hold beyond its outputs; it then picks its chunk and schedule itself
    # (kernel_contracts.flce_chunk_for_budget). Exclusive with flce_chunk.
    flce_memory_budget: int | None = Field(default=None, gt=0)
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows one mapped
    # segment per pool instead of reserving a segment per large allocation.
    expandable_segments: bool = False
    # The transformers release whose code runs the step (memplan.estimators.releases: what
    # changed between releases); None: the release the contracts were read off.
    transformers: str | None = Field(default=None, pattern=r"^\d+\.\d+(\.\d+)?")
    # Data parallelism over `gpus` ranks, each running `batch` sequences; the estimate is rank
    # 0's (the largest shards). None: one GPU, as the protocol runs it.
    gpus: int = Field(default=1, gt=0)
    strategy: Strategy | None = None
    # FSDP2: the decoder layers free their gathered weights after forward and gather them again
    # in backward (accelerate's fsdp_reshard_after_forward, default on).
    reshard_after_forward: bool = True
    # FSDP2: weights, gradients and optimizer states live on the CPU (CPUOffloadPolicy); ZeRO:
    # optimizer states (and, at stage 3, the weights) on the CPU.
    cpu_offload: bool = False
    # A multimodal config's vision tower and projector (ModelSpec.vision_tower_tensors) in the
    # estimate: "frozen" counts their weights, "trained" their gradients and optimizer states
    # too; None leaves them out (the text model alone). Their activations are never counted.
    count_vision_tower: VisionTower | None = None
    # Qwen3.5's and Qwen3-Next's gated DeltaNet layers: whose chunked delta rule runs them,
    # and whose causal conv
    deltanet_kernels: DeltaNetKernels = "torch"
    deltanet_conv: DeltaNetConv = "torch"

    @model_validator(mode="after")
    def _consistent(self) -> TrainSetup:
        unknown = [k for k in self.kernels if k not in KERNEL_NAMES]
        if unknown:
            raise ValueError(f"unknown kernel {unknown[0]!r}; valid: {', '.join(KERNEL_NAMES)}")
        if "cross_entropy" in self.kernels and "flce" in self.kernels:
            raise ValueError("cross_entropy and flce both compute the loss; give one")
        if self.flce_chunk is not None and self.flce_memory_budget is not None:
            raise ValueError("give flce_chunk or flce_memory_budget, not both")
        if self.gpus > 1 and self.strategy is None:
            raise ValueError(f"{self.gpus} GPUs need a strategy: one of {', '.join(STRATEGIES)}")
        if not self.reshard_after_forward and self.strategy != "fsdp2":
            raise ValueError("reshard_after_forward is an FSDP2 setting; the strategy is not fsdp2")
        if self.cpu_offload and self.strategy not in SHARDING_STRATEGIES:
            raise ValueError("cpu_offload needs a sharding strategy: fsdp2 or zero1/2/3")
        if self.count_vision_tower and self.strategy is not None:
            raise ValueError("count_vision_tower is modelled on one GPU, without a strategy")
        if self.count_vision_tower == "trained" and self.lora_rank:
            raise ValueError("under LoRA the vision tower is frozen: count it frozen")
        return self

    @property
    def distributed(self) -> bool:
        return self.strategy is not None


def make_setup(**fields: Any) -> TrainSetup:
    """TrainSetup, with a bad value reported as one UsageError line."""
    try:
        return TrainSetup(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "setup"
        raise UsageError(f"{where}: {first['msg']} (got {first.get('input')!r})") from None


# The TrainSetup fields that describe how the step is run, beside batch, seq and the kernels.
SETUP_OPTIONS = (
    "precision",
    "optimizer",
    "grad_checkpointing",
    "attn",
    "lora_rank",
    "lora_targets",
    "grad_accum",
    "expandable_segments",
    "transformers",
    "gpus",
    "strategy",
    "reshard_after_forward",
    "cpu_offload",
    "deltanet_kernels",
    "deltanet_conv",
)


# GPU memory a training process cannot give the caching allocator, where it was not measured:
# the CUDA context, loaded kernel modules and library handles, and what the driver keeps from
# nvidia-smi's total, measured on an H100 80GB (benchmarks/results_gpu_capacity_h100.json).
NOMINAL_OUTSIDE_ALLOCATOR = 85520809984 - 84209041408


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_bytes: int = Field(gt=0)  # nvidia-smi's total
    # What the caching allocator can reserve in a training process; measured where
    # capacity_measured, else memory_bytes less NOMINAL_OUTSIDE_ALLOCATOR.
    capacity_bytes: int | None = Field(default=None, gt=0)
    capacity_measured: bool = False
    compute_capability: tuple[int, int] = (9, 0)
    # Streaming multiprocessors (the datasheet's); kernels size per-SM scratch by it. None:
    # unknown (a GPU given by its memory alone).
    sm_count: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _capacity(self) -> Gpu:
        if self.capacity_bytes is None:
            nominal = self.memory_bytes - NOMINAL_OUTSIDE_ALLOCATOR
            if nominal <= 0:
                raise ValueError(
                    f"{self.memory_bytes:,} B of GPU memory leave nothing beside the "
                    f"{NOMINAL_OUTSIDE_ALLOCATOR / 2**20:.0f} MiB a training process uses outside "
                    "PyTorch's allocator"
                )
            object.__setattr__(self, "capacity_bytes", nominal)
        return self

    @property
    def capacity(self) -> int:
        assert self.capacity_bytes is not None
        return self.capacity_bytes


class TimelinePoint(BaseModel):
    """Allocated bytes right after one event of the step."""

    phase: str
    label: str
    allocated_bytes: int


class ReservedPrediction(BaseModel):
    """The step replayed through the model of PyTorch's caching allocator (estimators/allocator)
    on a GPU whose allocator can reserve capacity_bytes: whether it runs, and the
    torch.cuda.max_memory_reserved() it reaches (where it ran out of memory, when it does)."""

    capacity_bytes: int
    expandable_segments: bool = False
    runs: bool
    reserved_bytes: int
    oom_phase: str | None = None
    oom_label: str | None = None
    # whose event stream was replayed: the analytic walk's, or the traced step's (at the edge)
    method: str = "analytic"
    # max_memory_allocated over the run and by the end of step 1, as the replayed allocator's
    # blocks count it (None where it ran out of memory)
    allocated_bytes: int | None = None
    allocated_step1_bytes: int | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes


class MemoryEstimate(BaseModel):
    peak_bytes: int
    peak_step1_bytes: int
    peak_phase: str
    peak_label: str
    breakdown: dict[str, int]
    params: int
    trainable_params: int
    timeline: list[TimelinePoint] = Field(default_factory=list)
    reserved: ReservedPrediction | None = None
    # CPU memory per rank under CPU offload (offloaded weights, gradients, optimizer states)
    host_bytes: int = 0
    # analytic: the families' memory contracts; traced: the model's own code run on meta tensors
    method: Literal["analytic", "traced"] = "analytic"


class Plan(BaseModel):
    """What to switch on and how to split the batch: the advisor's answer, apply's input."""

    kernels: tuple[str, ...] = ()
    flce_chunk: int | None = Field(default=None, gt=0)
    flce_memory_budget: int | None = Field(default=None, gt=0)
    micro_batch: int | None = Field(default=None, gt=0)
    grad_accum: int = Field(default=1, gt=0)
    grad_checkpointing: bool = False
    predicted_peak_bytes: int | None = None


class KernelOption(BaseModel):
    kernels: tuple[str, ...]
    peak_bytes: int


class Suggestion(BaseModel):
    description: str
    setup: TrainSetup
    peak_bytes: int  # allocated
    fits: bool  # advisor.fits of its estimate: False for the closest option when none fits
    reserved_bytes: int = 0  # predicted reserved peak (where it runs out of memory, if not)


class GpuCount(BaseModel):
    """The fewest GPUs of the advised kind on which a strategy runs the step (None: no number
    does), rank 0's predicted peak there, and accelerate's config to launch it."""

    strategy: Strategy
    gpus: int | None
    peak_bytes: int  # allocated, at `gpus` (or at the most GPUs tried)
    reserved_bytes: int = 0
    # What else it changes in the setup to get there ("" for nothing), e.g. checkpointing.
    change: str = ""
    # How the strategy's model was checked (docs/distributed.md).
    checked: str
    why_none: str | None = None
    accelerate_config: str | None = None


class Advice(BaseModel):
    model: str
    setup: TrainSetup
    gpu: Gpu
    # Bytes of the GPU's capacity kept free at the user's request.
    safety_margin_bytes: int = 0
    peak_bytes: int  # allocated
    estimate: MemoryEstimate  # with its reserved-memory verdict
    plan: Plan
    fits: bool  # the step, replayed through the allocator model, runs
    headroom_bytes: int  # capacity less margin less the predicted reserved peak
    kernel_options: list[KernelOption] = Field(default_factory=list)
    # Bytes the peak would grow by without each of the plan's kernels (0: there for speed).
    kernel_savings: dict[str, int] = Field(default_factory=dict)
    suggestions: list[Suggestion] = Field(default_factory=list)
    max_batch: int | None = None
    # The largest sequence that fits at this batch, up to the model's max_position_embeddings.
    max_seq: int | None = None
    # When the step does not fit: for each strategy, the fewest GPUs that run it.
    gpu_counts: list[GpuCount] = Field(default_factory=list)
    # Parameters of a multimodal config's vision tower and projector (0 for a text model):
    # in the estimate only when setup.count_vision_tower says so, as warnings then say.
    vision_tower_params: int = 0
    warnings: list[str] = Field(default_factory=list)

    def __str__(self) -> str:
        """What `memplan advise` prints, as plain text (print(advice))."""
        from memplan.render import advice_text

        return advice_text(self)

    def __repr__(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"Advice({self.model!r}, batch={self.setup.batch}, seq={self.setup.seq}, "
            f"gpu={self.gpu.name!r}: {verdict}, peak {self.peak_bytes / GIB:.2f} GiB, "
            f"kernels={self.plan.kernels})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython and Jupyter show the advice as advise prints it."""
        printer.text(str(self))


class VerifyCase(BaseModel):
    """One run of the measurement protocol, as `memplan verify` hands it to its child process."""

    case: str
    model: str
    model_type: str
    # The config the model is built from (random init); with `checkpoint`, weights are loaded.
    hf_config: dict[str, Any] = Field(default_factory=dict, repr=False)
    checkpoint: str | None = None
    trust_remote_code: bool = False
    setup: TrainSetup
    steps: int = Field(default=3, ge=3)
    # Liger-Kernel's `_apply_liger_kernel_to_instance` instead of memplan's patch (benchmarks only).
    liger: bool = False
    mode: Literal["measure", "profile"] = "measure"
    # Record the allocator's history over one extra steady-state step after the measured ones.
    record_timeline: bool = False
    # Record every allocator event from before the model is built to the end of the measured
    # steps (Measurement.allocator_trace): the replay data of the allocator model's tests.
    record_allocator_trace: bool = False
    # A case of several GPUs: its ranks simulated in one process on one GPU, or one torchrun
    # process per GPU (memplan.verify.distributed).
    ranks: Literal["simulated", "torchrun"] = "simulated"


class MemoryEvent(BaseModel):
    """Allocated bytes after one allocator event of a measured step (index counts every event)."""

    index: int
    phase: str
    allocated_bytes: int


class ProfileOp(BaseModel):
    name: str
    device_ms: float  # per training step
    calls: float  # per training step
    share: float  # of the step's total device time


class ProfileTable(BaseModel):
    """torch.profiler over steady-state steps: operators by self device time, and GPU kernels."""

    steps: int
    total_device_ms: float  # per training step
    ops: list[ProfileOp] = Field(default_factory=list)
    kernels: list[ProfileOp] = Field(default_factory=list)


class Measurement(BaseModel):
    """One run of the measurement protocol (docs/measurement_protocol.md)."""

    case: str
    model: str
    setup: TrainSetup
    status: Literal["ok", "oom", "error"] = "ok"
    # no_gpu: CUDA missing or unusable; build: model, LoRA or patch failed; run: a step failed;
    # crash: the child process died without writing its result.
    error_kind: Literal["no_gpu", "build", "run", "crash"] | None = None
    steps: int = 3
    liger: bool = False
    model_type: str | None = None
    hf_config: dict[str, Any] = Field(default_factory=dict, repr=False)
    weights: Literal["random", "checkpoint"] = "random"
    n_params: int | None = None
    n_trainable: int | None = None
    after_model_bytes: int | None = None
    peak_step1_bytes: int | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None
    end_allocated_bytes: int | None = None
    oom_above_bytes: int | None = None
    error: str | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    loss: float | None = None
    applied: dict[str, Any] | None = None  # what memplan.patching.apply reported
    predicted: MemoryEstimate | None = None
    prediction_error: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    profile: dict[str, ProfileTable] | None = None  # "without_patch", "with_patch"
    profile_error: str | None = None
    timeline_measured: list[MemoryEvent] | None = None
    # GPU memory in use outside the caching allocator after the measured steps (CUDA context,
    # loaded kernel modules, library handles): total - free - reserved, from cudaMemGetInfo.
    non_allocator_bytes: int | None = None
    # (action, address, size) of every allocator event, in order, when the case asked for it.
    allocator_trace: list[tuple[str, int, int]] | None = Field(default=None, repr=False)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured of the steady peak, in %."""
        if self.predicted is None or not self.peak_bytes:
            return None
        return 100.0 * (self.predicted.peak_bytes - self.peak_bytes) / self.peak_bytes

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reserved_error_pct(self) -> float | None:
        """(predicted - measured) / measured of max_memory_reserved, in %, for a case that ran
        and was predicted to run."""
        reserved = self.predicted.reserved if self.predicted else None
        if reserved is None or not reserved.runs or self.status != "ok" or not self.reserved_bytes:
            return None
        return 100.0 * (reserved.reserved_bytes - self.reserved_bytes) / self.reserved_bytes

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdict_right(self) -> bool | None:
        """Whether the predicted verdict (runs, or runs out of memory) is what happened."""
        reserved = self.predicted.reserved if self.predicted else None
        if reserved is None or self.status not in ("ok", "oom"):
            return None
        return reserved.runs == (self.status == "ok")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def step1_error_pct(self) -> float | None:
        if self.predicted is None or not self.peak_step1_bytes:
            return None
        return (
            100.0
            * (self.predicted.peak_step1_bytes - self.peak_step1_bytes)
            / (self.peak_step1_bytes)
        )


class Report(BaseModel):
    """Measurements written by `memplan verify --out` and read by `memplan report`."""

    # Says what the numbers are when they are not measurements (test fixtures).
    label: str | None = None
    measurements: list[Measurement] = Field(default_factory=list)


class TrackResult(BaseModel):
    """What `memplan.track` saw around a user's training loop."""

    status: Literal["ok", "oom", "error"] = "ok"
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    seconds: float | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured in %, for a block that ran to its end."""
        if self.status != "ok" or self.predicted_peak_bytes is None:
            return None
        if not self.measured_peak_bytes:
            return None
        return (
            100.0
            * (self.predicted_peak_bytes - self.measured_peak_bytes)
            / (self.measured_peak_bytes)
        )
