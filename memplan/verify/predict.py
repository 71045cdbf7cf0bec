"""The prediction that goes next to a measurement: the estimator run on the exact config and setup
the child process built and trained. No torch here."""

from __future__ import annotations

from typing import Any

from memplan.errors import MemplanError
from memplan.schema import Gpu, Measurement, MemoryEstimate, ModelSpec, TrainSetup


def spec_from_hf_config(hf_config: dict[str, Any], name: str | None = None) -> ModelSpec:
    from memplan.catalog import spec_from_config

    return spec_from_config(dict(hf_config), name)


def with_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """The same model cut to its first `layers` decoder layers (the embedding, the final norm and
    the head unchanged): a big model's per-layer behaviour at a fraction of its memory."""
    if layers <= 0:
        raise MemplanError(f"layers must be a positive integer, got {layers}")
    config = dict(spec.hf_config)
    config.setdefault("model_type", spec.model_type)
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    name = f"{spec.name}-l{layers}" if spec.name else None
    return spec_from_hf_config(config, name)


def predict(spec: ModelSpec, setup: TrainSetup, gpu: Gpu | None = None) -> MemoryEstimate:
    from memplan.estimators import estimate

    return estimate(spec, setup, gpu)


def measured_gpu(measurement: Measurement, fallback: Gpu | None = None) -> Gpu | None:
    """The GPU the measurement ran on, from what the child recorded in its env (compute
    capability and total memory); `fallback` for results written before it did so."""
    env = measurement.env
    try:
        major, minor = (int(v) for v in env["compute_capability"].split("."))
        memory = int(env["gpu_total_bytes"])
    except (KeyError, ValueError):
        return fallback
    name = env.get("gpu") or "measured GPU"
    if fallback is not None:
        return fallback.model_copy(
            update={"name": name, "memory_bytes": memory, "compute_capability": (major, minor)}
        )
    return Gpu(name=name, memory_bytes=memory, compute_capability=(major, minor))


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
        predicted = predict(spec, measurement.setup, measured_gpu(measurement, gpu))
    except Exception as exc:  # the measurement must survive an estimator bug
        text = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {text[0] if text else ''}"
        return measurement.model_copy(update={"predicted": None, "prediction_error": reason})
    return measurement.model_copy(update={"predicted": predicted, "prediction_error": None})
