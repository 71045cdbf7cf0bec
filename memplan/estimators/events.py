"""A training step as the caching allocator sees it: allocations and releases, in order, by size.

The analytic walk (estimators/timeline.py) and the traced step (memplan/traced) both produce this
stream; the allocator model (estimators/allocator.py) replays it to predict reserved memory and
whether the step runs out of memory. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Action = Literal["alloc", "free"]

# A step of a forward program: ("alloc", key, bytes), ("free", key), ("saved",): the saved
# entries the program is keyed by are made here (("saved", n): the next n of them), ("mark",):
# the forward's high point inside it; ("unsaved",): under no_grad, those made so far are freed.
ForwardStep = tuple


# Not frozen: a walk makes hundreds of thousands of events, and frozen init costs 4x.
@dataclass(slots=True)
class Event:
    """One allocation (`nbytes` as requested, before the allocator rounds it) or the release of
    the allocation that `tensor` names. `category` is the breakdown key (weights, gradients,
    optimizer_states, activations, logits_and_loss, transient, ...); `phase` and `label` say
    where in the step it happens (forward / "layer 3")."""

    action: Action
    tensor: int
    nbytes: int
    category: str
    phase: str
    label: str
    stream: int = 0  # the CUDA stream it is allocated on (0: the default stream)


@dataclass
class EventLog:
    """Builds an event stream: `alloc` returns the id that `free` takes."""

    events: list[Event] = field(default_factory=list)
    step_ends: list[int] = field(default_factory=list)  # event counts where each step ends
    _live: dict[int, tuple[int, str, int]] = field(default_factory=dict)  # bytes, category, stream
    _next: int = 0

    def alloc(self, nbytes: int, category: str, phase: str, label: str, stream: int = 0) -> int:
        tensor = self._next
        self._next += 1
        self._live[tensor] = (nbytes, category, stream)
        self.events.append(Event("alloc", tensor, nbytes, category, phase, label, stream))
        return tensor

    def free(self, tensor: int, phase: str, label: str) -> None:
        nbytes, category, stream = self._live.pop(tensor)
        self.events.append(Event("free", tensor, nbytes, category, phase, label, stream))

    def retag(self, tensor: int, category: str) -> None:
        """Count a live allocation under another category from now on."""
        nbytes, _, stream = self._live[tensor]
        self._live[tensor] = (nbytes, category, stream)

    def size_of(self, tensor: int) -> tuple[int, str]:
        """(bytes, category) of an allocation not yet released."""
        nbytes, category, _ = self._live[tensor]
        return nbytes, category
