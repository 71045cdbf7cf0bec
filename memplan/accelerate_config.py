"""The `accelerate launch --config_file` YAML that runs a setup's data parallelism as memplan
models it (accelerate 1.15's keys; docs/distributed.md). Torch-free."""

from __future__ import annotations

from memplan.schema import TrainSetup

# accelerate's mixed_precision for each of memplan's precisions: bf16 and fp32 keep the model's
# own dtype; amp-* keeps fp32 weights and autocasts. DeepSpeed's bf16 mode is the only way it
# trains a bf16 model (bf16 weights, fp32 master).
ACCELERATE_MIXED_PRECISION = {"bf16": "no", "fp32": "no", "amp-bf16": "bf16", "amp-fp16": "fp16"}
DEEPSPEED_MIXED_PRECISION = {**ACCELERATE_MIXED_PRECISION, "bf16": "bf16"}


def _yaml(value: str) -> str:
    return "'no'" if value == "no" else value  # a bare no is YAML's false


_COMMON = """\
compute_environment: LOCAL_MACHINE
machine_rank: 0
main_training_function: main
num_machines: {machines}
num_processes: {gpus}
rdzv_backend: static
same_network: true
use_cpu: false"""


def accelerate_config(setup: TrainSetup, gpus_per_machine: int = 8) -> str:
    """The YAML for `setup.gpus` ranks of `setup.strategy` (machines of up to 8 GPUs)."""
    if setup.strategy is None:
        raise ValueError("a setup without a strategy runs on one GPU: no accelerate config")
    machines = -(-setup.gpus // gpus_per_machine)
    common = _COMMON.format(machines=machines, gpus=setup.gpus)
    mixed = ACCELERATE_MIXED_PRECISION[setup.precision]
    if setup.strategy == "ddp":
        body = f"distributed_type: MULTI_GPU\nmixed_precision: {_yaml(mixed)}"
    elif setup.strategy == "fsdp2":
        body = (
            "distributed_type: FSDP\n"
            f"mixed_precision: {_yaml(mixed)}\n"
            "fsdp_config:\n"
            "  fsdp_version: 2\n"
            "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            f"  fsdp_reshard_after_forward: {str(setup.reshard_after_forward).lower()}\n"
            f"  fsdp_offload_params: {str(setup.cpu_offload).lower()}\n"
            "  fsdp_cpu_ram_efficient_loading: true\n"
            "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
            # checkpointing, where the setup has it, is the model's own (TrainingArguments)
            "  fsdp_activation_checkpointing: false"
        )
    else:
        stage = int(setup.strategy[-1])
        offload_params = setup.cpu_offload and stage == 3
        body = (
            "distributed_type: DEEPSPEED\n"
            f"mixed_precision: {_yaml(DEEPSPEED_MIXED_PRECISION[setup.precision])}\n"
            "deepspeed_config:\n"
            f"  zero_stage: {stage}\n"
            f"  gradient_accumulation_steps: {setup.grad_accum}\n"
            f"  offload_optimizer_device: {'cpu' if setup.cpu_offload else 'none'}\n"
            f"  offload_param_device: {'cpu' if offload_params else 'none'}\n"
            f"  zero3_init_flag: {str(stage == 3).lower()}"
        )
    return f"{common}\n{body}\n"
