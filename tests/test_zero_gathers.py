"""ZeRO-3's gathered weights in the walk (memplan.estimators.zero): step 1 holds only the module
it runs; later steps hold the prefetcher's window, stage3_max_live_parameters elements (the
parameter that crosses the count included), through forward and into backward, shrinking once
fewer are left to use."""

from __future__ import annotations

from memplan.catalog import resolve_model
from memplan.estimators import estimate
from memplan.estimators.parallel import model_groups
from memplan.estimators.timeline import step_sizes, walk_run
from memplan.estimators.zero import MAX_LIVE_PARAMETERS, PERSISTENCE_PER_HIDDEN
from memplan.schema import TrainSetup
from memplan.verify.predict import with_layers


def setup_of(**fields) -> TrainSetup:
    return TrainSetup(batch=4, seq=2048, strategy="zero3", gpus=2, **fields)


def window_bytes(spec, setup: TrainSetup) -> int:
    """The window from the groups' own sizes: the tail's gathered parameters, then each layer's
    (backward order), until MAX_LIVE_PARAMETERS elements; bf16, padded to the ranks."""
    groups = model_groups(spec, setup)
    threshold = PERSISTENCE_PER_HIDDEN * spec.hidden_size
    layer = [p.numel for p in reversed(groups["layer"].params) if p.numel > threshold]
    order = [p.numel for p in groups["tail"].params if p.numel > threshold]
    order += layer * spec.num_hidden_layers
    count = total = 0
    for numel in order:
        if count >= MAX_LIVE_PARAMETERS:
            break
        count += numel
        total += -(-numel // setup.gpus) * setup.gpus * 2
    return total


def test_later_steps_hold_max_live_parameters_at_the_loss() -> None:
    spec = resolve_model("llama-3.2-1b")  # 1.24e9 elements: more than the window
    setup = setup_of()
    got = estimate(spec, setup)
    assert got.peak_label == "loss backward"
    assert got.breakdown["gathered_weights"] == window_bytes(spec, setup)
    assert MAX_LIVE_PARAMETERS * 2 <= got.breakdown["gathered_weights"]


def test_a_model_smaller_than_the_window_is_held_whole() -> None:
    spec = with_layers(resolve_model("llama-3.2-1b"), 4)  # 0.51e9 elements
    setup = setup_of()
    groups = model_groups(spec, setup)
    threshold = PERSISTENCE_PER_HIDDEN * spec.hidden_size
    whole = sum(
        -(-p.numel // 2) * 2 * 2
        for name, times in (("tail", 1), ("layer", spec.num_hidden_layers))
        for p in groups[name].params * times
        if p.numel > threshold
    )
    assert estimate(spec, setup).breakdown["gathered_weights"] == whole


def test_step_one_holds_nothing_at_the_loss_backward() -> None:
    """The first step records the trace: each module's weights are released after its forward
    (lm_head's too), so none are gathered at its peak, the loss's backward."""
    spec = resolve_model("llama-3.2-1b")
    setup = setup_of()
    first, steady = walk_run(spec, setup, step_sizes(spec, setup, None, "cuda"), record=False)[0]
    assert first.points[first.peak_index][1] == "loss backward"
    assert first.breakdown(first.peak_index).get("gathered_weights", 0) == 0
    assert steady.breakdown(steady.peak_index)["gathered_weights"] > 0
