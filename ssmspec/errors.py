"""Exceptions raised by ssmspec: every bad input gets a specific, named error."""

from __future__ import annotations


class SSMSpecError(Exception):
    """Base class of all ssmspec errors."""


class UnsupportedModelError(SSMSpecError, ValueError):
    """A module's recurrence does not go through a seam ssmspec knows how to make tree-aware."""

    def __init__(self, module_path: str, reason: str) -> None:
        self.module_path = module_path
        self.reason = reason
        super().__init__(f"ssmspec cannot transform module `{module_path}`: {reason}")


class InvalidTreeError(SSMSpecError, ValueError):
    """A token tree is malformed (empty, parent not before child, wrong shapes)."""


class VocabMismatchError(SSMSpecError, ValueError):
    """A draft model's vocabulary differs from the target's."""
