"""Choose kernels, the FLCE chunk size, micro-batching and checkpointing from predicted peaks.

Every decision here compares estimates of the same step; nothing is measured. A setup fits when
its step, replayed through the model of PyTorch's caching allocator with the GPU's capacity (less
any safety margin), completes (fits). Imports neither torch nor transformers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib.util import find_spec
from typing import Any

from memplan import edge_verdict
from memplan.catalog import (
    SUPPORTED_MODEL_TYPES,
    catalog_note,
    gpu_notes,
    model_config,
    parse_memory,
    resolve_gpu,
    resolve_model_input,
    substituted_entry,
    vision_tower_note,
)
from memplan.errors import MemplanError, UsageError, option_error
from memplan.estimators import estimate, predict_reserved, with_reserved
from memplan.estimators import kernel_contracts as kc
from memplan.estimators.contracts import DtypePlan
from memplan.estimators.deltanet import fla_autotuned_layer
from memplan.estimators.parallel import strategies_modelled
from memplan.estimators.params import (
    attention_lora_targets,
    check_lora_targets,
    default_lora_targets,
)
from memplan.estimators.releases import as_run_by, release_text
from memplan.families import FAMILIES
from memplan.limits import (
    MAX_BATCH,
    check_lora_rank,
    check_parallelism,
    check_setup,
    check_spec,
    largest_lora_rank,
)
from memplan.schema import (
    GLU_KERNEL_BY_ACTIVATION,
    KERNEL_NAMES,
    SHARDING_STRATEGIES,
    Advice,
    Gpu,
    GpuCount,
    KernelOption,
    MemoryEstimate,
    ModelSpec,
    Plan,
    ReservedPrediction,
    Suggestion,
    TrainSetup,
    make_setup,
)
from memplan.versions import installed_versions

# largest_batch stops its search here (about a million sequences); render says "at least".
MAX_BATCH_SEARCHED = MAX_BATCH

# Suggestions that change how the step runs, not what it computes.
EXPANDABLE_TEXT = (
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation of the allocator's cache "
    "decides the fit; no cost in speed)"
)
FUSED_ADAMW_TEXT = (
    "fused AdamW: torch.optim.AdamW(..., fused=True), the Trainer's optim='adamw_torch_fused' "
    "(the default foreach step's temporaries decide the fit)"
)

# Above this share of the capacity the default allocator's fragmentation decides whether a step
# runs, and the replay got 25 of 40 such verdicts right on an H100; with expandable segments,
# 4 of 4 (docs/fit_verdict.md).
EDGE_SHARE = 0.85
EDGE_WARNING = (
    "the allocated peak is within 15% of the GPU's capacity, where fragmentation of PyTorch's "
    "default allocator decides the fit and the prediction is least sure (docs/fit_verdict.md): "
    "run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)
# fla's first step can hold more than the walk's stream: its tuning, where Triton has not cached it
FLA_AUTOTUNE_WARNING = (
    "flash-linear-attention tunes its kernels in the first step of a process whose Triton cache "
    "lacks them: Triton's tuning buffers come beside step 1's peak, and a configuration that "
    "spills registers takes CUDA local memory outside PyTorch's allocator for the rest of the "
    "process (6.1 GiB on an H200 with Triton 3.6); a tuning that runs out of memory is not "
    "cached: one step at the same batch and a short sequence caches it before the long run "
    "(docs/fit_verdict.md)"
)

# Past a few thousand rows a chunk's (rows x hidden) @ (hidden x vocab) GEMM runs near the
# matmul peak already; larger chunks only add logits memory (benchmarks/bench_loss.py).
FLCE_CHUNK_CAP = 4096


def supported_kernels(spec: ModelSpec) -> tuple[str, ...]:
    """The memplan kernels that can replace an op of this architecture: its family's, or for a
    model type without one (the traced path) those its norm and activation name."""
    family = FAMILIES.get(spec.model_type)
    if family is not None:
        return family.kernels(spec.hidden_act, dense_mlp=spec.gated_mlps)
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
        raise option_error(
            "{} {value!r} names no kernel; say none for plain Hugging Face", "kernels", value=value
        )
    if names == ["auto"]:
        return None
    if names in (["none"], []):
        return ()
    supported = supported_kernels(spec)
    if names == ["all"]:
        return best_kernel_set(supported)
    words = [n for n in names if n in ("auto", "none", "all")]
    if words:
        raise option_error(
            "{} {word} stands alone, not in a list with other names", "kernels", word=words[0]
        )
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
        raise option_error(
            "{} cross_entropy and flce both compute the loss; pick one "
            "(flce also fuses the lm_head and never materializes the logits)",
            "kernels",
        )
    return tuple(k for k in KERNEL_NAMES if k in names)


def best_kernel_set(supported: Iterable[str]) -> tuple[str, ...]:
    """Every supported kernel; FLCE replaces the plain cross-entropy kernel."""
    chosen = set(supported)
    if "flce" in chosen:
        chosen.discard("cross_entropy")
    return tuple(k for k in KERNEL_NAMES if k in chosen)


def judge(
    spec: ModelSpec, setup: TrainSetup, gpu: Gpu, predicted: MemoryEstimate | None = None
) -> MemoryEstimate:
    """The estimate with its reserved-memory verdict on `gpu` (gpu.capacity: what the allocator
    may reserve). A step whose allocated peak exceeds the capacity cannot run, whatever the
    fragmentation (reserved >= allocated): it is judged without the replay."""
    predicted = predicted or estimate(spec, setup, gpu)
    if predicted.peak_bytes > gpu.capacity:
        reserved = ReservedPrediction(
            capacity_bytes=gpu.capacity,
            expandable_segments=setup.expandable_segments,
            runs=False,
            reserved_bytes=gpu.capacity,
            oom_phase=predicted.peak_phase,
            oom_label=predicted.peak_label,
        )
        return predicted.model_copy(update={"reserved": reserved})
    return with_reserved(predicted, predict_reserved(spec, setup, gpu))


def fits(estimate: MemoryEstimate) -> bool:
    """Whether a judged step runs: the one verdict every decision here uses."""
    return estimate.reserved is not None and estimate.reserved.runs


def runs(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> bool:
    return fits(judge(spec, setup, gpu))


def largest_passing(passes: Callable[[int], bool], ceiling: int, low: int = 0) -> int:
    """The largest n in (low, ceiling] that passes, `low` when none does, for a predicate that
    holds up to some n and not after: doubling from low + 1, then bisection."""
    if ceiling <= low or not passes(low + 1):
        return low
    good = low + 1
    while True:
        high = min(low + 2 * (good - low), ceiling)
        if high == good:
            return good
        if not passes(high):
            break
        good = high
    while high - good > 1:
        middle = (good + high) // 2
        good, high = (middle, high) if passes(middle) else (good, middle)
    return good


def largest_running(
    allocated_fits: Callable[[int], bool], replay_runs: Callable[[int], bool], ceiling: int
) -> int:
    """The largest n <= ceiling whose step runs. Allocated peaks (cheap) bound it from above,
    since reserved memory is at least the allocated peak; replays (dear) confirm the bound or,
    where fragmentation decides, search below it, nearest first."""
    top = largest_passing(allocated_fits, ceiling)
    if top == 0 or replay_runs(top):
        return top
    step, below = 1, top
    while below - step >= 1 and not replay_runs(below - step):
        below, step = below - step, 2 * step
    if below - step < 1:
        return largest_passing(replay_runs, below - 1) if below > 1 else 0
    return largest_passing(replay_runs, below - 1, low=below - step)


def parse_safety_margin(value: str | int | None, gpu: Gpu) -> int:
    """Bytes kept free of the allocator's capacity: None (none), bytes, a size ("2GiB") or a
    share of the capacity ("5%")."""
    if value is None:
        return 0
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 <= share < 100:
            raise option_error(
                "{} must be a share from 0% to under 100%, got {value!r}",
                "safety_margin",
                value=value,
            )
        return int(gpu.capacity * share / 100)
    try:
        return 0 if text in ("0", "none") else parse_memory(text)
    except UsageError:
        raise option_error(
            "{} must be a size such as 2GiB or a share such as 5%, got {value!r}",
            "safety_margin",
            value=value,
        ) from None


def choose_flce(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> dict[str, int | None]:
    """FLCE's setting, fastest first (a setup update: flce_chunk or flce_memory_budget).

    When the step still fits with it: a memory budget that holds the fp32-accumulator schedule
    at FLCE_CHUNK_CAP rows (three GEMMs per chunk, dW summed in fp32 inside cuBLAS; the kernel
    takes a single chunk when all rows fit in the same bytes). Its cost over the two-pass
    schedule is the fp32 (vocab x hidden) accumulator; its gain, one GEMM of 2 x rows x hidden x
    vocab FLOP fewer. Otherwise the two-pass schedule at the chunk choose_flce_chunk picks."""
    fast = fastest_flce(spec, setup)
    if fast is not None and runs(spec, setup.model_copy(update=fast), gpu):
        return fast
    return {"flce_chunk": choose_flce_chunk(spec, setup, gpu), "flce_memory_budget": None}


def fastest_flce(spec: ModelSpec, setup: TrainSetup) -> dict[str, int | None] | None:
    """The fp32-accumulator schedule's budget (a setup update) where it applies: bf16 or fp16
    projections, trained weights, more rows than FLCE_CHUNK_CAP."""
    tokens = setup.batch * setup.seq
    proj_bytes = DtypePlan.of(setup.precision).proj
    if proj_bytes == 4 or setup.lora_rank or tokens <= FLCE_CHUNK_CAP:
        return None
    budget = kc.flce_transient_bytes(
        tokens,
        spec.hidden_size,
        spec.vocab_size,
        proj_bytes,
        FLCE_CHUNK_CAP,
        schedule="one_pass_fp32_acc",
    )
    return {"flce_chunk": None, "flce_memory_budget": budget}


def advised_runs(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> bool:
    """Whether the step runs with the FLCE setting advise would choose (choose_flce), in at most
    two replays: the lightest setting, then the fastest (the replay of either can fit where the
    other's does not)."""
    if runs(spec, lightest_flce(spec, setup), gpu):
        return True
    fixed = setup.flce_chunk is not None or setup.flce_memory_budget is not None
    fast = None if "flce" not in setup.kernels or fixed else fastest_flce(spec, setup)
    return fast is not None and runs(spec, setup.model_copy(update=fast), gpu)


def choose_flce_chunk(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> int:
    """The largest power-of-two chunk (fewer, larger GEMMs) from the paper's formula up to
    FLCE_CHUNK_CAP (or the formula, when larger) that keeps the step within the GPU; below the
    formula only when even it does not fit, down to 64 rows; the formula when nothing fits.

    The peak grows with the chunk, so the chunk is found by bisection over the exponent:
    log2 of the range's estimates, not one estimate per halving."""
    tokens = setup.batch * setup.seq
    formula = kc.flce_default_chunk(tokens, spec.hidden_size, spec.vocab_size)
    top = max(formula, min(FLCE_CHUNK_CAP, 1 << max(0, (tokens - 1).bit_length())))

    def trial(exponent: int) -> TrainSetup:
        return setup.model_copy(update={"flce_chunk": 1 << exponent})

    first = min(64, formula).bit_length() - 1
    best = largest_running(
        lambda n: estimate(spec, trial(first + n - 1), gpu).peak_bytes <= gpu.capacity,
        lambda n: runs(spec, trial(first + n - 1), gpu),
        top.bit_length() - first,
    )
    # smaller chunks only help if they make the step fit
    return 1 << (first + best - 1) if best else formula


def largest_batch(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: Gpu,
    ceiling: int = MAX_BATCH_SEARCHED,
    traced: bool = False,
    known: Mapping[int, bool] | None = None,
) -> int:
    """The largest batch that advise would say fits with these kernels, FLCE's setting chosen
    for each batch as advise chooses it (0 if not even batch 1; `ceiling` when that fits).
    The bisection ends on a batch that fits next to one that does not. The lightest setting's
    allocated peak bounds the search; its replays judge each batch as advise would
    (advised_runs); `traced`: near the edge the traced step's, at the setting advise chooses,
    where it applies (edge_verdict); `known`: traced verdicts already made, by batch (not
    traced again)."""

    def trial(batch: int) -> TrainSetup:
        return lightest_flce(spec, setup.model_copy(update={"batch": batch}))

    def chosen(batch: int) -> TrainSetup:
        return with_flce_choice(spec, setup.model_copy(update={"batch": batch}), gpu)

    analytic = lambda b: advised_runs(spec, setup.model_copy(update={"batch": b}), gpu)  # noqa: E731
    replay = analytic
    if traced:
        traced_runs = edge_verdict.batch_runs(spec, chosen, gpu, analytic)
        replay = lambda b: known[b] if known and b in known else traced_runs(b)  # noqa: E731
    return largest_running(
        lambda b: estimate(spec, trial(b), gpu).peak_bytes <= gpu.capacity, replay, ceiling
    )


# largest_seq searches multiples of this many tokens (what training scripts pick anyway).
SEQ_STEP = 64


def largest_seq(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: Gpu,
    ceiling: int,
    traced: bool = False,
    known: Mapping[int, bool] | None = None,
) -> int:
    """The largest sequence length, a multiple of SEQ_STEP tokens, that fits at this batch and
    these kernels, FLCE's setting chosen as for largest_batch (0 if not even SEQ_STEP tokens;
    `ceiling` rounded down when that fits). `traced` and `known` (verdicts by multiple of
    SEQ_STEP) as for largest_batch."""

    def at(steps: int) -> TrainSetup:
        return setup.model_copy(update={"seq": steps * SEQ_STEP})

    def chosen(steps: int) -> TrainSetup:
        return with_flce_choice(spec, at(steps), gpu)

    analytic = lambda n: advised_runs(spec, at(n), gpu)  # noqa: E731
    replay = analytic
    if traced:
        traced_runs = edge_verdict.seq_runs(spec, chosen, gpu, analytic)
        replay = lambda n: known[n] if known and n in known else traced_runs(n)  # noqa: E731
    return SEQ_STEP * largest_running(
        lambda n: estimate(spec, lightest_flce(spec, at(n)), gpu).peak_bytes <= gpu.capacity,
        replay,
        ceiling // SEQ_STEP,
    )


# A gated DeltaNet layer's kernels that transformers takes from a package where it imports, by
# TrainSetup field: (the import name, which is also the field's value then; the distribution).
# fla's chunked delta rule and causal-conv1d's conv; "torch" where the package does not import.
DELTANET_FAST_PACKAGES = {
    "deltanet_kernels": ("fla", "flash-linear-attention"),
    "deltanet_conv": ("causal_conv1d", "causal-conv1d"),
}


def installed_deltanet() -> dict[str, str]:
    """The gated DeltaNet kernels transformers would run here, by TrainSetup field."""
    return {
        field: module if find_spec(module) else "torch"
        for field, (module, _) in DELTANET_FAST_PACKAGES.items()
    }


def deltanet_note(spec: ModelSpec, setup: TrainSetup) -> list[str]:
    """Which gated DeltaNet the estimate assumes, and where a package importable here would
    make transformers run another one than the estimate models."""
    if not spec.linear_attention_layers:
        return []
    layers = f"{spec.model_type}'s {len(spec.linear_attention_layers)} gated DeltaNet layers"
    rule = (
        "flash-linear-attention's chunk_gated_delta_rule"
        if setup.deltanet_kernels == "fla"
        else "transformers' torch_chunk_gated_delta_rule"
    )
    conv = "causal-conv1d's" if setup.deltanet_conv == "causal_conv1d" else "torch's"
    note = f"{layers} are estimated with {rule} and {conv} causal conv"
    here = installed_deltanet()
    differ = [
        f"{package} {'imports' if here[field] == module else 'does not import'}"
        for field, (module, package) in DELTANET_FAST_PACKAGES.items()
        if getattr(setup, field) != here[field]
    ]
    if differ:
        note += f"; {' and '.join(differ)} here, so transformers would run other kernels here"
    return [note]


def advise(
    model: Any,
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
    expandable_segments: bool = False,
    safety_margin: str | int | None = None,
    method: str | None = None,
    transformers: str | None = None,
    gpus: int = 1,
    strategy: str | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    count_vision_tower: str | None = None,
    deltanet_kernels: str | None = None,
    deltanet_conv: str | None = None,
    traced_verdict: bool = True,
) -> Advice:
    """Predict the peak of one training step and recommend what to switch on.

    `model`: a catalog name, a config.json path or folder, a hub id, a config dict, a
    transformers config or model (its config; the setup comes from these arguments), or a
    ModelSpec. lora_targets (a list, or a comma-separated string as on the command line) needs
    lora_rank, defaults to default_lora_targets(spec) and must name linears of the architecture.
    expandable_segments: the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    safety_margin: bytes (or a size such as "2GiB", or a share such as "5%" of the capacity)
    kept free of the allocator's capacity. `method`: None picks the analytic contracts for
    registry families and the traced estimate (memplan.traced) for any other model_type;
    "analytic" or "traced" forces one. `transformers`: the release that will run the step (None:
    the installed one); where it changed what a step holds (memplan.estimators.releases), the
    prediction follows it. `count_vision_tower`: a multimodal config's vision tower and
    projector are left out of the estimate (None, the text model alone), counted "frozen"
    (their weights; also what a text-only batch gives a trainable tower, which gets no
    gradient) or "trained" (weights, gradients, optimizer states); Advice.vision_tower_params
    says how many parameters they have. `deltanet_kernels`: whose chunked delta rule runs a
    gated DeltaNet layer, "torch" (transformers' fallback) or "fla" (flash-linear-attention);
    `deltanet_conv`: whose causal conv, "torch" or "causal_conv1d"; None: the package where it
    imports here, as transformers decides. Sizes past memplan.limits' bounds
    are errors that say the bound and why. `traced_verdict`: at the edge of the capacity the
    verdict and largest batch come from the traced step's stream where it applies
    (memplan.edge_verdict); False, or method="analytic", keeps the analytic replay everywhere
    (under 1 s)."""
    if method not in (None, "analytic", "traced"):
        raise option_error("{} must be analytic or traced, got {value!r}", "method", value=method)
    check_vision_tower_option(count_vision_tower, method, strategy, lora_rank)
    check_setup(
        batch=batch,
        seq=seq,
        grad_accum=grad_accum,
        lora_rank=lora_rank,
        flce_chunk=flce_chunk,
        gpus=gpus,
    )
    check_parallelism(gpus, strategy, reshard_after_forward, cpu_offload)
    if lora_targets is not None and lora_rank is None:
        raise option_error(
            "{} needs {} (without a rank there is no LoRA)", "lora_targets", "lora_rank"
        )
    gpu_spec = gpu if isinstance(gpu, Gpu) else resolve_gpu(gpu, gpu_mem)
    margin = parse_safety_margin(safety_margin, gpu_spec)
    if margin >= gpu_spec.capacity:
        raise option_error(
            "{} of {margin:,} B leaves nothing of the {capacity:,} B the allocator can reserve",
            "safety_margin",
            margin=margin,
            capacity=gpu_spec.capacity,
        )
    display_gpu, gpu_spec = (
        gpu_spec,
        gpu_spec.model_copy(update={"capacity_bytes": gpu_spec.capacity - margin}),
    )
    config, name = model_config(model, trust_remote_code=trust_remote_code)
    unknown = not isinstance(model, ModelSpec) and config.get("model_type") not in (
        SUPPORTED_MODEL_TYPES
    )
    installed = installed_versions()["transformers"]
    release = _checked_release(transformers) or installed
    if method == "traced" or (method is None and unknown):
        if transformers is not None and release != installed:
            raise option_error(
                "{} {value} is not the installed release ({installed}): the traced estimate "
                "runs the installed transformers' code",
                "transformers",
                value=transformers,
                installed=installed,
            )
        return _traced_advice(
            config,
            name or str(config.get("model_type")),
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
        ).model_copy(update={"gpu": display_gpu, "safety_margin_bytes": margin})
    spec, notes = resolve_model_input(
        model if isinstance(model, ModelSpec) else config, trust_remote_code=trust_remote_code
    )
    if isinstance(model, str):  # a catalog entry not written from its checkpoint says so
        notes = notes + catalog_note(name)
    if name and spec.name is None:
        spec = spec.model_copy(update={"name": name})
    check_spec(spec)
    if count_vision_tower and not spec.vision_tower_tensors:
        raise option_error(
            "{} counts a multimodal config's vision tower (model_type gemma3 or mistral3); "
            "{model} is a text model",
            "count_vision_tower",
            model=spec.name or spec.model_type,
        )
    if isinstance(lora_targets, str):
        lora_targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
    targets = (
        default_lora_targets(spec) if lora_targets is None else tuple(dict.fromkeys(lora_targets))
    )
    if lora_rank:
        check_lora_targets(spec, targets)
        check_lora_rank(spec, lora_rank, targets)
    deltanet = installed_deltanet()  # what transformers would run here, unless asked
    asked_deltanet = {"deltanet_kernels": deltanet_kernels, "deltanet_conv": deltanet_conv}
    deltanet.update({field: kernel for field, kernel in asked_deltanet.items() if kernel})
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
        expandable_segments=expandable_segments,
        gpus=gpus,
        strategy=strategy,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        count_vision_tower=count_vision_tower,
        **deltanet,
    )
    warnings = []
    base, asked = as_run_by(spec.model_type, base, release), base
    if base.attn != asked.attn:
        warnings.append(
            f"transformers {release} refuses SDPA for {spec.model_type} and builds it with eager "
            "attention: predicted with eager"
        )
    entry = substituted_entry(model) if isinstance(model, str) else None
    if entry is not None:
        warnings.append(
            f"{model.strip()!r} is not in the catalog; predicting for the catalog's {entry.key} "
            f"({entry.hf_id}), the closest name: give a config.json path for another config"
        )
    warnings += notes
    if base.cpu_offload and base.strategy is not None:
        warnings.append(offload_check(base.strategy))
    warnings += vision_tower_note(spec, count_vision_tower, DtypePlan.of(precision).param)
    warnings += deltanet_note(spec, base)
    if seq > spec.max_position_embeddings:
        warnings.append(
            f"seq {seq} is longer than the model's max_position_embeddings "
            f"{spec.max_position_embeddings}"
        )
    grouped = spec.num_key_value_heads < spec.num_attention_heads
    warnings += gpu_notes(gpu_spec, base.precision, base.attn, grouped)
    requested = parse_kernels(kernels, spec)
    if flce_chunk is not None and requested is not None and "flce" not in requested:
        raise option_error(
            "{} sets the flce kernel's chunk, but {} leaves flce out", "flce_chunk", "kernels"
        )
    supported = supported_kernels(spec)
    options = kernel_options(spec, base, gpu_spec, supported)
    chosen = requested if requested is not None else recommend(options)
    if flce_chunk is not None and "flce" not in chosen:
        warnings.append(f"the FLCE chunk {flce_chunk} is unused: the plan leaves flce out")
    setup = base.model_copy(
        update={"kernels": chosen, "flce_chunk": flce_chunk if "flce" in chosen else None}
    )
    planned = setup
    setup = with_flce_choice(spec, setup, gpu_spec)
    analytic = estimate(spec, setup, gpu_spec)
    result = with_reserved(analytic, predict_reserved(spec, setup, gpu_spec))
    # the traced step is asked only where the step itself is at the edge: advise stays fast
    traced_verdict = (
        traced_verdict and method != "analytic" and edge_verdict.at_edge(result, gpu_spec)
    )
    known: dict[int, bool] = {}
    if traced_verdict:
        result = edge_verdict.judged_at_edge(spec, setup, gpu_spec, result)
        if result.reserved is not None and result.reserved.method == "traced":
            warnings.append(edge_verdict.NOTE)
            known[setup.batch] = result.reserved.runs  # the search's replay at this batch
    max_batch = largest_batch(spec, planned, gpu_spec, traced=traced_verdict, known=known)
    known_seq = {seq // SEQ_STEP: known[batch]} if batch in known and seq % SEQ_STEP == 0 else {}
    max_seq = largest_seq(
        spec,
        planned,
        gpu_spec,
        max(seq, spec.max_position_embeddings),
        traced=traced_verdict,
        known=known_seq,
    )
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
    fit = fits(result)
    assert result.reserved is not None
    near = EDGE_SHARE * gpu_spec.capacity < result.peak_bytes <= gpu_spec.capacity
    if near and not setup.expandable_segments:
        warnings.append(EDGE_WARNING)
    if near and fla_autotuned_layer(spec, setup) is not None:
        warnings.append(FLA_AUTOTUNE_WARNING)
    if not fit and not spec.uniform_layers:
        warnings.append(
            f"{spec.model_type}'s layers of two attention geometries are modelled on one GPU "
            "only: no GPU count is given for DDP, FSDP2 or ZeRO"
        )
    elif not fit and not strategies_modelled(spec):
        warnings.append(
            f"{spec.model_type} is estimated on one GPU only: how many GPUs a data-parallel "
            "strategy needs is not modelled for its MoE layers (dense layers beside them, an fp32 "
            "router, or every token through every expert)"
        )
    return Advice(
        model=spec.name or spec.model_type,
        setup=setup,
        gpu=display_gpu,
        safety_margin_bytes=margin,
        peak_bytes=result.peak_bytes,
        estimate=result,
        plan=plan,
        fits=fit,
        headroom_bytes=result.reserved.headroom_bytes,
        kernel_options=compared,
        # by the walk's tensors on both sides, as estimate gives each set without the replay
        kernel_savings=kernel_savings(spec, setup, gpu_spec, analytic.peak_bytes),
        suggestions=[]
        if fit
        else suggestions(spec, setup, gpu_spec, supported, flce_chunk=flce_chunk, judged=result),
        max_batch=max_batch,
        max_seq=max_seq,
        # a counted vision tower, and some architectures, are modelled on one GPU only
        gpu_counts=[]
        if fit or count_vision_tower or not strategies_modelled(spec)
        else gpu_counts(spec, setup, gpu_spec),
        vision_tower_params=spec.vision_tower_params,
        warnings=warnings,
    )


def check_vision_tower_option(
    value: str | None, method: str | None, strategy: str | None, lora_rank: int | None
) -> None:
    """UsageError unless count_vision_tower is None, "frozen" or "trained" and the rest of the
    setup is one the vision tower is modelled in."""
    if value is None:
        return
    if value not in ("frozen", "trained"):
        raise option_error(
            "{} must be frozen or trained, got {value!r}", "count_vision_tower", value=value
        )
    if method == "traced":
        raise option_error(
            "{} is counted by the analytic estimate; the traced one builds the text model alone",
            "count_vision_tower",
        )
    if strategy is not None:
        raise option_error(
            "{} is modelled on one GPU: a strategy would shard the vision tower in a group "
            "memplan does not model (leave out {})",
            "count_vision_tower",
            "strategy",
        )
    if value == "trained" and lora_rank:
        raise option_error(
            "under LoRA the vision tower is frozen with the rest of the base model: give {} frozen",
            "count_vision_tower",
        )


def _checked_release(transformers: str | None) -> str | None:
    """A transformers release as given ('5.24.0'), or None; anything else is a usage error."""
    if transformers is None:
        return None
    try:
        return release_text(str(transformers))
    except ValueError:
        raise option_error(
            "{} must be a transformers release such as 5.17.0, got {value!r}",
            "transformers",
            value=transformers,
        ) from None


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


def kernel_savings(spec: ModelSpec, setup: TrainSetup, gpu: Gpu, peak: int) -> dict[str, int]:
    """For each of the setup's kernels, the bytes the predicted peak would grow by without it
    (the other kernels and FLCE's setting kept); 0 means it saves no memory here and is there
    for speed."""
    savings = {}
    for kernel in setup.kernels:
        update: dict[str, Any] = {"kernels": tuple(k for k in setup.kernels if k != kernel)}
        if kernel == "flce":
            update.update(flce_chunk=None, flce_memory_budget=None)
        without = estimate(spec, setup.model_copy(update=update), gpu).peak_bytes
        savings[kernel] = max(0, without - peak)
    return savings


def suggestions(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: Gpu,
    supported: tuple[str, ...],
    most: int = 4,
    *,
    flce_chunk: int | None = None,
    judged: MemoryEstimate | None = None,
) -> list[Suggestion]:
    """Changes that make the step fit, in order of what they cost in speed or in what is
    trained: the full kernel set (faster, when the setup's kernels are not it already), then,
    with the setup's own kernels, micro-batching, checkpointing and LoRA, then these with the
    full set. Each keeps the setup's kernels unless its description says it changes them, and
    names every change: kernels, micro-batch and accumulation steps, checkpointing, LoRA, and
    FLCE's setting (chosen as advise chooses it, said when that replaces the user's
    `flce_chunk`). Each with its predicted peak; when nothing fits, the closest. Before these,
    what costs no speed when it decides the fit (`judged`: the setup's verdict): expandable
    segments when the allocated peak fits but fragmentation does not, and fused AdamW when the
    foreach step's temporaries run out of memory."""
    full = best_kernel_set(supported)
    own = setup.kernels
    sequences = setup.batch * setup.grad_accum
    adapted = attention_lora_targets(spec)
    rank = min(16, largest_lora_rank(spec, adapted) or 16)
    lora: dict[str, Any] = {"lora_rank": rank, "lora_targets": adapted}
    if setup.count_vision_tower:
        lora["count_vision_tower"] = "frozen"  # LoRA freezes the tower with the base model
    on = f"LoRA r={rank} on {', '.join(adapted)}"
    changes: list[tuple[str, dict[str, Any]]] = []
    if not setup.grad_checkpointing:
        changes.append(("gradient checkpointing (~30% slower steps)", {"grad_checkpointing": True}))
    if not setup.lora_rank:
        changes.append((f"{on} (base frozen)", lora))
        if not setup.grad_checkpointing:
            changes.append(
                (f"{on} and gradient checkpointing", {**lora, "grad_checkpointing": True})
            )
    switch = f"kernels {', '.join(full) or 'none'} instead of {', '.join(own) or 'none'}"
    ladder: list[tuple[list[str], tuple[str, ...], dict[str, Any]]] = []
    judged = judged or judge(spec, setup, gpu)
    assert judged.reserved is not None
    if not setup.expandable_segments and judged.peak_bytes <= gpu.capacity:
        ladder.append(([EXPANDABLE_TEXT], own, {"expandable_segments": True}))
    if setup.optimizer == "adamw" and judged.reserved.oom_phase == "optimizer":
        ladder.append(([FUSED_ADAMW_TEXT], own, {"optimizer": "adamw-fused"}))
    if full != own:
        ladder.append(([switch], full, {}))
    ladder.append(([], own, {}))  # micro-batching alone
    ladder += [([text], own, change) for text, change in changes]
    if full != own:
        ladder += [([switch, text], full, change) for text, change in changes]
    found: list[Suggestion] = []
    tried: list[Suggestion] = []
    for described, kernels, change in ladder:
        trial = setup.model_copy(
            update={"kernels": kernels, "flce_chunk": None, "flce_memory_budget": None, **change}
        )
        # Only divisors up to the largest batch whose allocated peak fits can fit (reserved
        # memory is at least that); each is judged by replay, largest first.
        ceiling = min(setup.batch, MAX_BATCH_SEARCHED)
        bound = max(
            1,
            largest_passing(
                lambda b, t=trial: (
                    estimate(
                        spec, lightest_flce(spec, t.model_copy(update={"batch": b})), gpu
                    ).peak_bytes
                    <= gpu.capacity
                ),
                ceiling,
            ),
        )
        for micro in _divisors_desc(setup.batch, bound):
            candidate = with_flce_choice(
                spec,
                trial.model_copy(update={"batch": micro, "grad_accum": sequences // micro}),
                gpu,
            )
            parts = list(described)
            if micro != setup.batch:
                parts.append(f"micro-batch {micro} x {sequences // micro} accumulation steps")
            if flce_chunk is not None and candidate.flce_chunk != flce_chunk:
                parts.append(f"memplan's FLCE setting instead of your chunk of {flce_chunk} rows")
            if not parts:
                continue  # the setup as it is: it does not fit
            predicted = judge(spec, candidate, gpu)
            fit = fits(predicted)
            tried.append(
                Suggestion(
                    description="; ".join(parts),
                    setup=candidate,
                    peak_bytes=predicted.peak_bytes,
                    fits=fit,
                    reserved_bytes=predicted.reserved.reserved_bytes if predicted.reserved else 0,
                )
            )
            if fit:
                found.append(tried[-1])
                break
        if len(found) >= most:
            break
    if found:
        return found
    return sorted(tried, key=lambda s: s.peak_bytes)[:1]


# How each strategy's memory model was checked (docs/distributed.md).
STRATEGY_CHECKS = {
    "fsdp2": "35 cases measured on H100s and an H200: within 1.45% (9 under amp with "
    "checkpointing, predicted before they ran: within 4.15% then); 4 also on two real GPUs, as "
    "simulated",
    "ddp": "6 cases measured on H100s: within 0.01%; some runs hold one more bf16 gradient copy",
    "zero1": "1 case measured on two H100s: within 0.01%",
    "zero2": "2 cases measured on two H100s: within 0.02%",
    "zero3": "2 cases measured on two H100s: -0.01%, and -8.9% (under) with memplan's kernels",
}
# How CPU offload's model was checked (docs/distributed.md).
OFFLOAD_CHECKS = {
    "fsdp2": "CPU offload: 4 cases measured on an H100 (simulated ranks): within 0.06%",
    "zero": "CPU offload predicted from DeepSpeed's code; unmeasured (verify cannot run its "
    "CPU Adam)",
}


def offload_check(strategy: str) -> str:
    return OFFLOAD_CHECKS["fsdp2" if strategy == "fsdp2" else "zero"]


# The order advise lists them in: the least communication first among those that shard.
GPU_COUNT_STRATEGIES = ("fsdp2", "zero2", "zero3", "zero1", "ddp")


# gpu_counts searches up to this many GPUs (what a fine-tuning run would take at most).
GPU_COUNT_CEILING = 1024


def gpu_counts(spec: ModelSpec, setup: TrainSetup, gpu: Gpu) -> list[GpuCount]:
    """For each strategy, the fewest GPUs of this kind (up to GPU_COUNT_CEILING) whose rank 0
    runs the step: with each rank running the setup's micro-batch; where no count does, with
    gradient checkpointing; then also with a micro-batch of 1 and the sequences as
    accumulation steps. Rank 0's allocated peak falls as the ranks grow until only what no
    strategy shards is left (activations, logits, a gathered layer): the count is bisected on
    allocated peaks, then confirmed by the allocator replay, a few counts upward while
    fragmentation decides."""
    from memplan.accelerate_config import accelerate_config

    variants = [("", {})]
    if not setup.grad_checkpointing:
        variants.append(("with gradient checkpointing", {"grad_checkpointing": True}))
    if setup.batch > 1:
        sequences = setup.batch * setup.grad_accum
        variants.append(
            (
                f"with gradient checkpointing, micro-batch 1 x {sequences} accumulation steps",
                {"grad_checkpointing": True, "batch": 1, "grad_accum": sequences},
            )
        )
    counts = []
    for strategy in GPU_COUNT_STRATEGIES:
        found, change, judged = None, "", None
        # offload is an option of the sharding strategies only
        offload = setup.cpu_offload and strategy in SHARDING_STRATEGIES
        # DDP's ranks hold what one GPU does and more: no count helps where one does not
        for description, update in variants if strategy != "ddp" else variants[:1]:

            def trial(
                n: int, update: dict = update, strategy: str = strategy, offload: bool = offload
            ) -> TrainSetup:
                return lightest_flce(
                    spec,
                    setup.model_copy(
                        update={**update, "gpus": n, "strategy": strategy, "cpu_offload": offload}
                    ),
                )

            def allocated_fits(n: int, trial=trial) -> bool:
                return estimate(spec, trial(n), gpu).peak_bytes <= gpu.capacity

            ceiling = 1 if strategy == "ddp" else GPU_COUNT_CEILING
            bound = _smallest(allocated_fits, ceiling)
            for n in _upward(bound or ceiling, ceiling) if bound else [ceiling]:
                judged = judge(spec, trial(n), gpu)
                if bound is not None and fits(judged):
                    found, change = n, description
                    break
            if found is not None:
                break
        assert judged is not None
        why = None
        if found is None:
            why = (
                "each rank holds the whole model and a second copy of its gradients"
                if strategy == "ddp"
                else f"at {GPU_COUNT_CEILING:,} GPUs, even with checkpointing and a micro-batch "
                "of 1, rank 0 holds more than the GPU"
            )
        reserved = judged.reserved
        counts.append(
            GpuCount(
                strategy=strategy,
                gpus=found,
                peak_bytes=judged.peak_bytes,
                reserved_bytes=reserved.reserved_bytes if reserved and reserved.runs else 0,
                change=change,
                checked=offload_check(strategy) if offload else STRATEGY_CHECKS[strategy],
                why_none=why,
                accelerate_config=accelerate_config(
                    setup.model_copy(
                        update={"gpus": found, "strategy": strategy, "cpu_offload": offload}
                    )
                )
                if found
                else None,
            )
        )
    return counts


def _smallest(passes: Callable[[int], bool], most: int) -> int | None:
    """The smallest n <= most that passes, by bisection (None when not even `most` does):
    rank 0 only loses shards as n grows."""
    if not passes(most):
        return None
    low, high = 0, most
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle, high)
    return high


def _upward(n: int, most: int) -> list[int]:
    """n, then 9/8, 5/4, 3/2 and 2 times n (rounded up), up to `most`: where the allocated
    peak only just fits, fragmentation needs a few percent more room."""
    steps = [n] + [-(-n * num // den) for num, den in ((9, 8), (5, 4), (3, 2), (2, 1))]
    return sorted({min(s, most) for s in steps})


def lightest_flce(spec: ModelSpec, setup: TrainSetup) -> TrainSetup:
    """The setup at the smallest FLCE chunk choose_flce_chunk considers, unless FLCE's setting
    is fixed already: the peak grows with the chunk, and the two-pass schedule at that chunk
    holds less than the fp32-accumulator one, so its allocated peak bounds every setting advise
    would choose (one estimate instead of a search; replays of the settings may still differ)."""
    if "flce" in setup.kernels and setup.flce_chunk is None and setup.flce_memory_budget is None:
        tokens = setup.batch * setup.seq
        formula = kc.flce_default_chunk(tokens, spec.hidden_size, spec.vocab_size)
        return setup.model_copy(update={"flce_chunk": min(64, formula)})
    return setup


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
