"""memplan.verify: run the measurement protocol (docs/measurement_protocol.md) in a
fresh subprocess per case and set the measured peak beside the prediction; reports and plots.

    verify(model, batch=, seq=, plan=, **setup) -> Report     one or many cases, measured
    track(plan)                                                context manager around any loop
    run_case(VerifyCase) -> Measurement                        one case, one fresh process
    verify_command, report_command                             click commands for memplan/cli.py

Imported lazily: nothing here imports torch in the parent process."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "verify": "memplan.verify.api",
    "execute": "memplan.verify.api",
    "track": "memplan.verify.tracking",
    "Tracker": "memplan.verify.tracking",
    "run_case": "memplan.verify.runner",
    "plan_cases": "memplan.verify.cases",
    "verify_command": "memplan.verify.cli",
    "report_command": "memplan.verify.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memplan.verify' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class _CallablePackage(types.ModuleType):
    """`memplan.verify(...)` is the API function, yet importing this package makes
    `memplan.verify` the package (the import system sets the attribute on the parent); so the
    package itself calls through to the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from memplan.verify.api import verify

        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
