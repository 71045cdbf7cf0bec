"""Choose kernels, the FLCE chunk size, micro-batching and checkpointing from predicted peaks.

Every decision here compares estimates of the same step; nothing is measured. Imports neither
torch nor transformers, so `memplan advise` answers in well under a second."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.catalog import (
    SUPPORTED_MODEL_TYPES,
    resolve_config,
    resolve_gpu,
    spec_from_config,
    substituted_entry,
)
from memplan.errors import MemplanError, UsageError
from memplan.estimators import estimate
from memplan.estimators import kernel_contracts as kc
from memplan.estimators.contracts import DtypePlan
from memplan.estimators.params import (
    attention_lora_targets,
    check_lora_targets,
    default_lora_targets,
)
from memplan.schema import (
    GLU_KERNEL_BY_ACTIVATION,
    KERNEL_NAMES,
    Advice,
    Gpu,
    KernelOption,
    MemoryEstimate,
    ModelSpec,
    Plan,
    Suggestion,
    TrainSetup,
    make_setup,
)

# The caching allocator reserves more than it hands out (fragmentation): the protocol's
# reference runs reserved 1.04x (fused loss) to 1.13x (HF loss) their allocated peak. A plan
# fits when its predicted allocated peak stays under this share of the allocator's memory.
ALLOCATOR_MARGIN = 0.90

# largest_batch stops its search here (about a million sequences); render says "at least".
MAX_BATCH_SEARCHED = 2**20

# Past a few thousand rows a chunk's (rows x hidden) @ (hidden x vocab) GEMM runs near the
# matmul peak already; larger chunks only add logits memory (benchmarks/bench_loss.py).
FLCE_CHUNK_CAP = 4096


def supported_kernels(spec: ModelSpec) -> tuple[str, ...]:
    """The memplan kernels that can replace an op of this architecture."""
    kernels = ["rms_norm" if spec.norm == "rms" else "layer_norm", "rope"]
    glu = GLU_KERNEL_BY_ACTIVATION.get(spec.hidden_act)
    if glu and not spec.num_experts:
        kernels.append(glu)
    kernels += ["cross_entropy", "flce", "embedding"]
    return tuple(k for k in KERNEL_NAMES if k in kernels)


def parse_kernels(value: str | Iterable[str] | None, spec: ModelSpec) -> tuple[str, ...] | None:
    """'auto' (None: let the advisor choose), 'none', 'all', or a comma-separated list."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    names = [n for n in names if n]
    if isinstance(value, str) and not names:
        raise UsageError(f"--kernels {value!r} names no kernel; say none for plain Hugging Face")
    if names == ["auto"]:
        return None
    if names in (["none"], []):
        return ()
    supported = supported_kernels(spec)
    if names == ["all"]:
        return best_kernel_set(supported)
    words = [n for n in names if n in ("auto", "none", "all")]
    if words:
        raise UsageError(f"--kernels {words[0]} stands alone, not in a list with other names")
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise UsageError(
            f"unknown kernel {unknown[0]!r}; choose from auto, none, all, {', '.join(KERNEL_NAMES)}"
        )
    unsupported = [n for n in names if n not in supported]
    if unsupported:
        raise UsageError(
            f"kernel {unsupported[0]!r} does not apply to {spec.model_type}; "
            f"it supports {', '.join(supported)}"
        )
    if "cross_entropy" in names and "flce" in names:
        raise UsageError(
            "--kernels cross_entropy and flce both compute the loss; pick one "
            "(flce also fuses the lm_head and never materializes the logits)"
        )
    return tuple(k for k in KERNEL_NAMES if k in names)


def best_kernel_set(supported: Iterable[str]) -> tuple[str, ...]:
    """Every supported kernel; FLCE replaces the plain cross-entropy kernel."""
    chosen = set(supported)
    if "flce" in chosen:
        chosen.discard("cross_entropy")
    return tuple(k for k in KERNEL_NAMES if k in chosen)


def usable_bytes(gpu: Gpu) -> int:
    return int((gpu.memory_bytes - gpu.context_bytes) * ALLOCATOR_MARGIN)


def fits(estimate: MemoryEstimate, gpu: Gpu) -> bool:
    """Whether the estimated step runs on the GPU: the one verdict every decision here uses."""
    return estimate.peak_bytes <= usable_bytes(gpu)


def choose_flce(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> dict[str, int | None]:
    """FLCE's setting, fastest first (a setup update: flce_chunk or flce_memory_budget).

    When the step still fits with it: a memory budget that holds the fp32-accumulator schedule
    at FLCE_CHUNK_CAP rows (three GEMMs per chunk, dW summed in fp32 inside cuBLAS; the kernel
    takes a single chunk when all rows fit in the same bytes). Its cost over the two-pass
    schedule is the fp32 (vocab x hidden) accumulator; its gain, one GEMM of 2 x rows x hidden x
    vocab FLOP fewer. Otherwise the two-pass schedule at the chunk choose_flce_chunk picks."""
    tokens = setup.batch * setup.seq
    proj_bytes = DtypePlan.of(setup.precision).proj
    accumulates = proj_bytes < 4 and not setup.lora_rank and tokens > FLCE_CHUNK_CAP
    if accumulates:
        budget = kc.flce_transient_bytes(
            tokens,
            spec.hidden_size,
            spec.vocab_size,
            proj_bytes,
            FLCE_CHUNK_CAP,
            schedule="one_pass_fp32_acc",
        )
        fast = {"flce_chunk": None, "flce_memory_budget": budget}
        if fits(estimate(spec, setup.model_copy(update=fast), gpu), gpu):
            return fast
    return {"flce_chunk": choose_flce_chunk(spec, setup, gpu), "flce_memory_budget": None}


def choose_flce_chunk(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> int:
    """Start from the paper's formula; take the largest power-of-two chunk (fewer, larger GEMMs)
    that keeps the predicted peak within the usable memory, and go below the formula only when
    even it does not fit."""
    tokens = setup.batch * setup.seq
    formula = kc.flce_default_chunk(tokens, spec.hidden_size, spec.vocab_size)
    top = max(formula, min(FLCE_CHUNK_CAP, 1 << max(0, (tokens - 1).bit_length())))

    def fits_with(chunk: int) -> bool:
        return fits(estimate(spec, setup.model_copy(update={"flce_chunk": chunk}), gpu), gpu)

    chunk = top
    while chunk > formula and not fits_with(chunk):
        chunk //= 2
    smallest = chunk
    while smallest > 64 and not fits_with(smallest):
        smallest //= 2
    # Smaller chunks only help if they make the step fit.
    return smallest if fits_with(smallest) else chunk


def largest_batch(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu, ceiling: int = MAX_BATCH_SEARCHED
) -> int:
    """The largest batch that advise would say fits with these kernels, FLCE's setting chosen
    for each batch as advise chooses it (0 if not even batch 1; `ceiling` when that fits).
    The bisection ends on a batch that fits next to one that does not."""

    def fits_at(batch: int) -> bool:
        trial = with_flce_choice(spec, setup.model_copy(update={"batch": batch}), gpu)
        return fits(estimate(spec, trial, gpu), gpu)

    if not fits_at(1):
        return 0
    low = 1
    while True:
        high = min(2 * low, ceiling)
        if high == low:
            return ceiling
        if not fits_at(high):
            break
        low = high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits_at(middle) else (low, middle)
    return low


def advise(
    model: str | ModelSpec,
    batch: int,
    seq: int,
    *,
    gpu: str | Gpu | None = None,
    gpu_mem: str | None = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
    grad_checkpointing: bool = False,
    attn: str = "sdpa",
    lora_rank: int | None = None,
    lora_targets: Iterable[str] | None = None,
    grad_accum: int = 1,
    kernels: str | Iterable[str] | None = "auto",
    flce_chunk: int | None = None,
    trust_remote_code: bool = False,
    method: str | None = None,
) -> Advice:
    """Predict the peak of one training step and recommend what to switch on. lora_targets
    defaults to default_lora_targets(spec) and must name linears of the architecture (a list,
    or a comma-separated string as on the command line). `method`: None picks the analytic
    contracts for registry families and the traced estimate (memplan.traced) for any other
    model_type; "analytic" or "traced" forces one."""
    if method not in (None, "analytic", "traced"):
        raise UsageError(f"--method must be analytic or traced, got {method!r}")
    gpu_spec = gpu if isinstance(gpu, Gpu) else resolve_gpu(gpu, gpu_mem)
    optional = {"lora-rank": lora_rank, "flce-chunk": flce_chunk}
    counts = {"batch": batch, "seq": seq, "grad-accum": grad_accum}
    counts.update({name: value for name, value in optional.items() if value is not None})
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {value!r}")
    if isinstance(model, ModelSpec):
        config = {**model.hf_config, "model_type": model.model_type}
        name = model.name or model.model_type
    else:
        config, name = resolve_config(model, trust_remote_code=trust_remote_code)
    unknown = not isinstance(model, ModelSpec) and config.get("model_type") not in (
        SUPPORTED_MODEL_TYPES
    )
    if method == "traced" or (method is None and unknown):
        return _traced_advice(
            config,
            name,
            batch,
            seq,
            gpu=gpu_spec,
            reason=_traced_reason(config, forced=method == "traced"),
            precision=precision,
            optimizer=optimizer,
            grad_checkpointing=grad_checkpointing,
            attn=attn,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            grad_accum=grad_accum,
            kernels=kernels,
            flce_chunk=flce_chunk,
            trust_remote_code=trust_remote_code,
        )
    spec = model if isinstance(model, ModelSpec) else spec_from_config(config, name=name)
    if isinstance(lora_targets, str):
        lora_targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
    targets = (
        default_lora_targets(spec) if lora_targets is None else tuple(dict.fromkeys(lora_targets))
    )
    if lora_rank:
        check_lora_targets(spec, targets)
    base = make_setup(
        batch=batch,
        seq=seq,
        precision=precision,
        optimizer=optimizer,
        grad_checkpointing=grad_checkpointing,
        attn=attn,
        lora_rank=lora_rank,
        lora_targets=targets,
        grad_accum=grad_accum,
        flce_chunk=flce_chunk,
    )
    warnings = []
    entry = substituted_entry(model) if isinstance(model, str) else None
    if entry is not None:
        warnings.append(
            f"{model.strip()!r} is not in the catalog; predicting for the catalog's {entry.key} "
            f"({entry.hf_id}), the closest name: give a config.json path for another config"
        )
    if seq > spec.max_position_embeddings:
        warnings.append(
            f"seq {seq} is longer than the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    requested = parse_kernels(kernels, spec)
    if flce_chunk is not None and requested is not None and "flce" not in requested:
        raise UsageError("--flce-chunk sets the flce kernel's chunk, but --kernels leaves flce out")
    supported = supported_kernels(spec)
    options = kernel_options(spec, base, gpu_spec, supported)
    chosen = requested if requested is not None else recommend(options)
    if flce_chunk is not None and "flce" not in chosen:
        warnings.append(f"--flce-chunk {flce_chunk} is unused: the plan leaves flce out")
    setup = base.model_copy(
        update={"kernels": chosen, "flce_chunk": flce_chunk if "flce" in chosen else None}
    )
    max_batch = largest_batch(spec, setup, gpu_spec)
    setup = with_flce_choice(spec, setup, gpu_spec)
    result = estimate(spec, setup, gpu_spec)
    limit = usable_bytes(gpu_spec)
    plan = Plan(
        kernels=chosen,
        flce_chunk=setup.flce_chunk,
        flce_memory_budget=setup.flce_memory_budget,
        micro_batch=batch,
        grad_accum=grad_accum,
        grad_checkpointing=grad_checkpointing,
        predicted_peak_bytes=result.peak_bytes,
    )
    # The plan's kernel set is compared at the plan's FLCE setting, the others at their default.
    plan_row = KernelOption(kernels=chosen, peak_bytes=result.peak_bytes)
    compared = [plan_row if o.kernels == chosen else o for o in options]
    if chosen not in {o.kernels for o in options}:
        compared.append(plan_row)
    return Advice(
        model=spec.name or spec.model_type,
        setup=setup,
        gpu=gpu_spec,
        peak_bytes=result.peak_bytes,
        estimate=result,
        plan=plan,
        fits=fits(result, gpu_spec),
        headroom_bytes=limit - result.peak_bytes,
        kernel_options=compared,
        suggestions=[]
        if fits(result, gpu_spec)
        else suggestions(spec, setup, gpu_spec, supported, flce_chunk=flce_chunk),
        max_batch=max_batch,
        warnings=warnings,
    )


def _traced_reason(config: dict, *, forced: bool) -> str:
    model_type = config.get("model_type")
    if forced:
        return (
            "estimated by tracing the model's transformers code on meta tensors (--method traced)"
        )
    return (
        f"model_type {model_type!r} has no family entry: estimated by tracing its transformers "
        "code on meta tensors (method traced); no memplan kernels apply"
    )


def _traced_advice(config: dict, name: str, batch: int, seq: int, **options) -> Advice:
    """memplan.traced's advice; it imports torch and transformers, which the analytic path
    never does."""
    try:
        from memplan.traced.advise import traced_advice
    except ImportError as exc:
        raise MemplanError(
            f"the traced estimate of {config.get('model_type')!r} needs torch and transformers "
            f"({exc}): pip install torch transformers"
        ) from exc
    return traced_advice(config, name, batch, seq, **options)


def kernel_options(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu, supported: tuple[str, ...]
) -> list[KernelOption]:
    """Predicted peaks of: no kernels, each kernel alone, and the full set."""
    singles = [(k,) for k in supported]
    sets = [(), *singles, best_kernel_set(supported)]
    return [
        KernelOption(
            kernels=s,
            peak_bytes=estimate(spec, setup.model_copy(update={"kernels": s}), gpu).peak_bytes,
        )
        for s in dict.fromkeys(sets)
    ]


def recommend(options: list[KernelOption]) -> tuple[str, ...]:
    """The lowest predicted peak; among equal peaks the set with more kernels (they are also
    faster than the ops they replace: docs/benchmarks.md)."""
    best = min(options, key=lambda o: (o.peak_bytes, -len(o.kernels)))
    return best.kernels


def suggestions(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: Gpu,
    supported: tuple[str, ...],
    most: int = 4,
    *,
    flce_chunk: int | None = None,
) -> list[Suggestion]:
    """Changes that make the step fit, in order of what they cost in speed or in what is
    trained: kernels, then micro-batching, then checkpointing, then LoRA. Each with its
    predicted peak (FLCE's setting chosen as advise chooses it, and the description says so
    when that replaces the user's `flce_chunk`); when nothing fits, the closest."""
    kernels = best_kernel_set(supported)
    sequences = setup.batch * setup.grad_accum
    adapted = attention_lora_targets(spec)
    lora = {"lora_rank": 16, "lora_targets": adapted}
    on = f"LoRA r=16 on {', '.join(adapted)}"
    ladder: list[tuple[str, dict]] = [("kernels " + ", ".join(kernels), {})]
    if not setup.grad_checkpointing:
        ladder.append(("gradient checkpointing (~30% slower steps)", {"grad_checkpointing": True}))
    if not setup.lora_rank:
        ladder.append((f"{on} (base frozen)", lora))
        if not setup.grad_checkpointing:
            ladder.append(
                (f"{on} and gradient checkpointing", {**lora, "grad_checkpointing": True})
            )
    found: list[Suggestion] = []
    tried: list[Suggestion] = []
    for description, change in ladder:
        trial = setup.model_copy(
            update={"kernels": kernels, "flce_chunk": None, "flce_memory_budget": None, **change}
        )
        # Only divisors up to the largest batch that fits can fit (and no more than a million
        # sequences per micro-batch are searched).
        ceiling = min(setup.batch, MAX_BATCH_SEARCHED)
        bound = max(1, largest_batch(spec, trial, gpu, ceiling=ceiling))
        for micro in _divisors_desc(setup.batch, bound):
            candidate = with_flce_choice(
                spec,
                trial.model_copy(update={"batch": micro, "grad_accum": sequences // micro}),
                gpu,
            )
            predicted = estimate(spec, candidate, gpu)
            peak = predicted.peak_bytes
            text = (
                description
                if micro == setup.batch
                else (
                    f"{description}; micro-batch {micro} x {sequences // micro} accumulation steps"
                )
            )
            if flce_chunk is not None and candidate.flce_chunk != flce_chunk:
                text += f"; leave out --flce-chunk {flce_chunk} (memplan sets FLCE's chunk)"
            tried.append(Suggestion(description=text, setup=candidate, peak_bytes=peak))
            if fits(predicted, gpu):
                found.append(tried[-1])
                break
        if len(found) >= most:
            break
    if found:
        return found
    return sorted(tried, key=lambda s: s.peak_bytes)[:1]


def with_flce_choice(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> TrainSetup:
    """The setup with FLCE's setting chosen by choose_flce, unless it is fixed already."""
    if "flce" in setup.kernels and setup.flce_chunk is None and setup.flce_memory_budget is None:
        return setup.model_copy(update=choose_flce(spec, setup, gpu))
    return setup


def _divisors_desc(n: int, most: int) -> list[int]:
    """The divisors of n that are at most `most`, largest first: O(min(most, sqrt(n)))."""
    small, large = [], []
    d = 1
    while d * d <= n and d <= most:
        if n % d == 0:
            small.append(d)
            if n // d <= most and n // d != d:
                large.append(n // d)
        d += 1
    return sorted(small + large, reverse=True)
