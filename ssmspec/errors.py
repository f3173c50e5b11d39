"""Exceptions raised by ssmspec: every bad input gets a specific, named error."""

from __future__ import annotations


class SSMSpecError(Exception):
    """Base class of all ssmspec errors."""


class UnsupportedModelError(SSMSpecError, ValueError):
    """ssmspec cannot verify (part of) a model exactly: the module is named, and why (a recurrence outside any
    known seam, an argument a seam adapter does not know, a tree that would give other values than HF, ...)."""

    def __init__(self, module_path: str, reason: str) -> None:
        self.module_path = module_path
        self.reason = reason
        super().__init__(f"ssmspec cannot verify `{module_path}` exactly: {reason}")


class InvalidTreeError(SSMSpecError, ValueError):
    """A token tree is malformed (empty, parent not before child, wrong shapes)."""


class VocabMismatchError(SSMSpecError, ValueError):
    """A draft model's vocabulary differs from the target's."""


class UnsupportedSettingError(SSMSpecError, NotImplementedError, ValueError):
    """A generation setting (or generate argument) that speculative decoding does not apply exactly: refused,
    named, never ignored. Both a NotImplementedError and a ValueError, so either `except` catches it."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        super().__init__(message)


class CaptureError(SSMSpecError, RuntimeError):
    """A verify step could not be captured as a graph (SpecConfig.graphs): the op that read the host, or the
    device's refusal, and where in the model's code it was called."""
