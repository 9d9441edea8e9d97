"""Errors a user can cause, reported as one line naming the parameter and the rule it broke."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the CLI prints ``error: <parameter>: <rule>`` and exits with status 2."""

    exit_code = 2

    def __init__(self, parameter: str, rule: str) -> None:
        super().__init__(f"{parameter}: {rule}")
        self.parameter = parameter
        self.rule = rule


def require(condition: bool, parameter: str, rule: str) -> None:
    """Raise :class:`UserError` unless ``condition`` holds."""
    if not condition:
        raise UserError(parameter, rule)


def positive_int(value: object, parameter: str) -> int:
    """Return ``value`` as an int, or raise if it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(parameter, f"must be a positive integer, got {value!r}")
    return value
