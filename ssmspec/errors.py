"""Exceptions raised by ssmspec: every bad input gets a specific, named error."""

from __future__ import annotations

# refusals that more than one place raises (a call's plan before anything runs, and the runner or config that a call
# by hand reaches): each message written here once
GENERIC_GRAPHS = "captured steps (SpecConfig.graphs) need the seams: the generic path (HF's own cache) has none"


# a runner asked to verify while the previous tree is neither committed nor discarded
PENDING_TREE = "commit or discard the previous tree before verifying another"


def not_one_of(name: str, value: object, choices: object) -> ValueError:
    """The error of a setting that must be one of `choices`: named, with what was given."""
    return ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def trees_inexact(found: str) -> str:
    """The refusal of trees on a model whose transform-time probe found them inexact (`found`: what it found)."""
    return ("tree verification is not exact for this model, only chains: use SpecConfig(tree=False), or leave `tree` "
            f"unset (found at transform: {found})")  # fmt: skip


def batches_inexact(found: str) -> str:
    """The refusal of a batch on a model whose transform-time probe found batches inexact (`found`: what it found)."""
    return ("speculative decoding of a batch is not exact for this model, only one prompt at a time (found at "
            f"transform: {found})")  # fmt: skip


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
