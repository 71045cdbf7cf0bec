"""Errors a user can cause. The CLI prints them as one `Error:` line; MEMPLAN_DEBUG=1 shows the
traceback."""

from __future__ import annotations

from typing import Any


class MemplanError(Exception):
    """Bad input or an unsupported situation; exit code 1."""

    exit_code = 1


class UsageError(MemplanError):
    """A malformed argument (not a positive integer, an unknown name); exit code 2.

    `cli_message` is the same message with the command line's option names (--batch) where
    str() has Python's (batch); None when the message names no option."""

    exit_code = 2

    def __init__(self, message: str, *, cli_message: str | None = None) -> None:
        super().__init__(message)
        self.cli_message = cli_message


def flag(option: str) -> str:
    """The command-line spelling of a Python option name: flce_chunk -> --flce-chunk."""
    return "--" + option.replace("_", "-")


def option_error(template: str, *options: str, **values: Any) -> UsageError:
    """A UsageError about options named the Python way (batch, flce_chunk): each `{}` in the
    template takes the next option, each `{name}` a value; `cli_message` names the options as
    flags (--batch, --flce-chunk), so the Python API and the command line each speak their own."""
    return UsageError(
        template.format(*options, **values),
        cli_message=template.format(*map(flag, options), **values),
    )


def positive_int(option: str, value: str | None, *, required: bool = False) -> int | None:
    """A command-line option that must be a positive integer (None when absent)."""
    if value is None:
        if required:
            raise UsageError(f"{option} is required")
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise UsageError(f"{option} must be a positive integer, got {value!r}")
    return number
