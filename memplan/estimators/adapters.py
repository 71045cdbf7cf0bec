"""peft's LoRA adapters in a layer's forward, as the allocator sees them: where each adapter's
saved tensors are made, and the temporaries of its forward around them. Pure Python.

peft's Linear.forward (lora/layer.py) computes `result = base_layer(x)`, then
`result = result + lora_B(lora_A(x)) * scaling` and casts the sum back to the base output's
dtype. So beside the saved tensors (contracts.layer_saved's "lora.<target>": A's input cast,
A's output) it holds the base output, B's output, the scaled product and the sum, each as wide as
the linear's output. Without autocast the adapters are fp32 (peft's autocast_adapter_dtype):
B's output, the product and the sum are fp32, and the sum is cast back to the model's dtype.

Under LoRA the frozen down_proj saves no input (nor does it where memplan's GLU kernel
recomputes the product): the gated MLP's product, act(gate) * up, is a temporary of the
forward, alive until down_proj (and its adapter) has run."""

from __future__ import annotations

from memplan.estimators.contracts import FP32, LayerContext, Saved
from memplan.estimators.events import ForwardStep
from memplan.estimators.params import LORA_TARGET_SHAPES, layer_lora_targets

# What each adapted linear reads, as the name of the layer_saved entries that make it (its
# adapter's saved tensors follow them in the forward), by target.
READS = {
    "q_proj": ("norm.attn", "attn.in"),
    "k_proj": ("norm.attn", "attn.in"),
    "v_proj": ("norm.attn", "attn.in"),
    "qkv_proj": ("norm.attn", "attn.in"),
    "o_proj": ("attn.out",),
    "gate_proj": ("norm.mlp", "mlp.in"),
    "up_proj": ("norm.mlp", "mlp.in"),
    "gate_up_proj": ("norm.mlp", "mlp.in"),
    "down_proj": ("mlp.",),
}


def adapter_program(ctx: LayerContext, target: str, tokens: int) -> list[ForwardStep]:
    """One adapter's forward for `tokens` rows: the base output, its input cast up to fp32
    (under autocast, where it is not fp32 already), the adapter's saved tensors, B's output,
    the scaled product (B's output freed), the sum (the product and the base output freed),
    its cast back to the model's dtype where the adapter computes in fp32."""
    d = ctx.dtypes
    fan_in, fan_out = LORA_TARGET_SHAPES[target](ctx.spec)
    base = tokens * fan_out * d.proj
    wide = tokens * fan_out * (d.proj if d.autocast else FP32)
    # under autocast the adapters stay fp32: an input in the matmuls' dtype (attention's output,
    # the MLP's product) is cast up for A, a temporary beside the low-precision copy A saves
    reads_proj = READS.get(target) in (READS["o_proj"], READS["down_proj"])
    cast_up = tokens * fan_in * FP32 if d.autocast and reads_proj and d.proj < FP32 else 0
    steps: list[ForwardStep] = [("alloc", "base", base), ("alloc", "in", cast_up), ("saved",)]
    steps += [("alloc", "b", wide), ("alloc", "scaled", wide), ("free", "b")]
    steps += [("alloc", "sum", wide), ("mark",), ("free", "scaled"), ("free", "base")]
    steps += [("free", "in")]
    if wide != base:  # the sum cast back: the linear's output, which the walk counts elsewhere
        steps += [("alloc", "cast", base), ("free", "sum"), ("free", "cast")]
    else:
        steps += [("free", "sum")]
    return steps


def forward_programs(ctx: LayerContext, saved: Saved, tokens: int) -> dict[str, list[ForwardStep]]:
    """The forward's temporaries, keyed by the layer_saved entries (`saved`, in forward_order)
    they surround: under LoRA each adapter's (adapter_program, by "lora.<target>"), and where
    down_proj saves no input (it is frozen, or memplan's SwiGLU kernel recomputes its input)
    the gated MLP's product, from the MLP's last saved entry through down_proj (latent
    attention's adapters keep no program)."""
    targets = layer_lora_targets(ctx.spec, ctx.setup) if ctx.setup.lora_rank else []
    programs = {f"lora.{t}": adapter_program(ctx, t, tokens) for t in targets if t in READS}
    names = [name for name, _, _ in saved.tensors]
    mlp = [name for name in names if name.startswith("mlp.")]
    if ctx.moe or not mlp or "mlp.down_in" in names:
        return programs
    product = [("alloc", "product", tokens * ctx.spec.intermediate_size * ctx.dtypes.proj)]
    down = programs.get("lora.down_proj")
    if down is not None:
        programs["lora.down_proj"] = product + down + [("free", "product")]
    elif "rms_norm" in ctx.kernels and "norm.post_mlp" in names[names.index(mlp[-1]) :]:
        # memplan's norm after the MLP keeps its input, down_proj's output: its first entry
        programs[mlp[-1]] = [("saved",), *product]
        programs["norm.post_mlp"] = [("saved", 1), ("mark",), ("free", "product"), ("saved",)]
    else:
        # down_proj's output outlives the product it is made from
        out = [("alloc", "down", tokens * ctx.spec.hidden_size * ctx.dtypes.proj)]
        programs[mlp[-1]] = [("saved",), *product, *out, ("mark",), ("free", "product")]
        programs[mlp[-1]] += [("free", "down")]
    return programs


def forward_order(saved: Saved, targets: list[str]) -> Saved:
    """`saved` with each adapter's entries ("lora.<target>", "lora.weights.<target>") moved to
    where the forward makes them: after the last entry of what the adapted linear reads
    (READS), adapters of one input in the order of `targets`."""
    tensors = list(saved.tensors)
    for target in targets:
        reads = READS.get(target)
        own = [t for t in tensors if t[0] in (f"lora.{target}", f"lora.weights.{target}")]
        if reads is None or not own:
            continue
        rest = [t for t in tensors if t not in own]
        anchors = [i for i, t in enumerate(rest) if t[0].startswith(reads)]
        if not anchors:
            continue
        at = anchors[-1] + 1
        # after the adapters of the same input placed already
        while at < len(rest) and rest[at][0].startswith("lora."):
            at += 1
        tensors = rest[:at] + own + rest[at:]
    return Saved(dict(saved.per_token), dict(saved.constant), tensors)
