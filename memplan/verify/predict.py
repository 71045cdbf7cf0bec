"""The prediction that goes next to a measurement: the estimator run on the exact config and setup
the child process built and trained. No torch here."""

from __future__ import annotations

from typing import Any

from memplan.errors import MemplanError
from memplan.schema import Gpu, Measurement, MemoryEstimate, ModelSpec, TrainSetup


def spec_from_hf_config(hf_config: dict[str, Any], name: str | None = None) -> ModelSpec:
    from memplan.catalog import spec_from_config

    return spec_from_config(dict(hf_config), name)


# config lists with one entry per layer, and lists of layer indices (transformers checks both
# against num_hidden_layers, e.g. Llama 4 derives its layer types from no_rope_layers)
PER_LAYER_FLAGS = ("layer_types", "no_rope_layers")
LAYER_INDEX_LISTS = ("moe_layers", "mlp_only_layers")


def with_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """The same model cut to its first `layers` decoder layers (the embedding, the final norm and
    the head unchanged): a big model's per-layer behaviour at a fraction of its memory."""
    if layers <= 0:
        raise MemplanError(f"layers must be a positive integer, got {layers}")
    config = dict(spec.hf_config)
    config.setdefault("model_type", spec.model_type)
    config["num_hidden_layers"] = layers
    for key in PER_LAYER_FLAGS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    for key in LAYER_INDEX_LISTS:
        if isinstance(config.get(key), list):
            config[key] = [i for i in config[key] if i < layers]
    name = f"{spec.name}-l{layers}" if spec.name else None
    return spec_from_hf_config(config, name)


def predict(spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None) -> MemoryEstimate:
    """The allocated peak and, on a known GPU, the reserved peak and out-of-memory verdict."""
    from memplan.estimators import estimate, predict_reserved, with_reserved

    predicted = estimate(spec, setup, gpu)
    if gpu is None:
        return predicted
    return with_reserved(predicted, predict_reserved(spec, setup, gpu))


def measured_gpu(measurement: Measurement, fallback: Gpu | None = None) -> Gpu | None:
    """The GPU the measurement ran on, from what the child recorded in its env (compute
    capability and total memory); `fallback` for results written before it did so. Its
    capacity is the total less what the run held outside the allocator where it recorded that,
    else the catalog's measured capacity for that device, else nominal."""
    env = measurement.env
    try:
        major, minor = (int(v) for v in env["compute_capability"].split("."))
        memory = int(env["gpu_total_bytes"])
    except (KeyError, ValueError):
        return fallback
    name = env.get("gpu") or "measured GPU"
    capacity = None
    if measurement.non_allocator_bytes:
        capacity = memory - measurement.non_allocator_bytes
    else:
        known = _catalog_gpu(name)
        capacity = known.capacity if known is not None and known.capacity_measured else None
    return Gpu(
        name=name,
        memory_bytes=memory,
        capacity_bytes=capacity,
        capacity_measured=capacity is not None,
        compute_capability=(major, minor),
    )


def _catalog_gpu(device_name: str) -> Gpu | None:
    from memplan.catalog import resolve_gpu
    from memplan.errors import UsageError

    try:
        return resolve_gpu(device_name)
    except UsageError:
        return None


def ran_setup(measurement: Measurement) -> TrainSetup:
    """The measured setup, naming the transformers release the child ran where it did not."""
    from memplan.estimators.releases import release_text

    ran = measurement.env.get("transformers", "")
    if measurement.setup.transformers is not None:
        return measurement.setup
    try:
        version = release_text(ran)
    except ValueError:  # not recorded, or not a release
        return measurement.setup
    return measurement.setup.model_copy(update={"transformers": version})


def attach_prediction(
    measurement: Measurement, spec: ModelSpec | None = None, gpu: Gpu | None = None
) -> Measurement:
    """The measurement with the estimator's prediction, or with `prediction_error` saying why
    there is none; the measured figures are kept either way. The prediction is for the GPU the
    measurement ran on where its result says which, else for `gpu`. Liger runs get no
    prediction: the estimator models Hugging Face's ops and memplan's kernels, not Liger's."""
    if measurement.liger:
        return measurement
    try:
        if spec is None:
            spec = spec_from_hf_config(measurement.hf_config, measurement.model)
        predicted = predict(spec, ran_setup(measurement), measured_gpu(measurement, gpu))
    except Exception as exc:  # the measurement must survive an estimator bug
        text = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {text[0] if text else ''}"
        return measurement.model_copy(update={"predicted": None, "prediction_error": reason})
    return measurement.model_copy(update={"predicted": predicted, "prediction_error": None})
