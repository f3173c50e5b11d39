"""How a transformed model was compiled, read in one place: `model.compile` (Dynamo: the call it was compiled with,
the backend's mode and options) or `transform(compile=True)` on a CPU (its steps captured and compiled whole by a
step compiler), and what that asks of a call (captured steps, static shapes). `ssmspec.transform` writes these on
the model; the call's plan, its runners, a draft model and the feature capture read them through `compiled_as`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class CompiledAs:
    """What `compiled_as` found on a model.

    `call`: the (args, kwargs) of its `model.compile` (None: not compiled by Dynamo); `options`: the backend, mode
    and options of that compilation (what ssmspec compiles the model's commit with); `step_compiler`: the compiler
    of its captured steps (`transform(compile=True)` on a CPU); `graphs`: its calls capture their steps by default;
    `static_shapes`: its calls pad trees to fixed buckets by default."""

    call: tuple | None = None
    options: dict[str, Any] | None = None
    step_compiler: Any = None
    graphs: bool = False
    static_shapes: bool = False

    @property
    def compiled(self) -> bool:
        """Compiled at all: by Dynamo, or its steps compiled whole."""
        return self.call is not None or self.step_compiler is not None


def compiled_as(model: nn.Module | None) -> CompiledAs:
    """How `model` was compiled (a model ssmspec did not compile, or None: nothing)."""
    if model is None:
        return CompiledAs()
    return CompiledAs(
        call=getattr(model, "ssmspec_compile_call", None), options=getattr(model, "ssmspec_compile_options", None),
        step_compiler=model.__dict__.get("_ssmspec_step_compiler"),
        graphs=bool(getattr(model, "ssmspec_graphs", False)),
        static_shapes=bool(getattr(model, "ssmspec_static_shapes", False)),
    )  # fmt: skip
