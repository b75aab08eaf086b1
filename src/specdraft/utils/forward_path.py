"""How a frozen model's forward runs on this machine: a registry of exact execution paths and the measured choice.

Why: on CPUs eager ``F.linear`` with a few rows (a verify block of 2-9 tokens) pays about twice a
GEMV's memory traffic, so a target forward of 8 tokens cost 1.7-1.9x one token on a 2-core EPYC;
the same linear through oneDNN with its weight reordered once into oneDNN's blocked layout does
not (``benchmarks/forward_path.py``), and it needs no compilation (``torch.compile`` with frozen
weights prepacks the same way, after 1-2.5 min of compiling per shape on that CPU). Which path is
faster depends on the machine and the model, so ``auto`` times decode-shaped work on each
applicable path once per machine and model (``utils/measured.py``), logs the figures and keeps the
fastest; eager is preferred unless another is clearly faster. A path changes how modules compute,
never their parameters or state_dict, and every path is exact up to float reassociation (logits
within ``LOGIT_TOLERANCE`` of eager, tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry
from specdraft.utils.measured import Measurement, measured_choice

AUTO = "auto"
EAGER = "eager"
#: Largest |logit - eager logit| a path may produce (fp32 reassociation; tests/test_forward_path.py holds tiny targets to it).
LOGIT_TOLERANCE = 2e-3


@dataclass(frozen=True)
class ForwardPath:
    """One way to execute a model's forward: whether it applies to (device, parameter dtype), and how to
    switch a model onto it (``install``) and back (``uninstall``); both are idempotent and in place.
    ``installed`` says whether a model holds modules of this path (eager installs none)."""

    name: str
    applies: Callable[[torch.device, torch.dtype], bool]
    install: Callable[[nn.Module], None]
    uninstall: Callable[[nn.Module], None]
    installed: Callable[[nn.Module], bool] = lambda model: False


FORWARD_PATHS: Registry[ForwardPath] = Registry("forward path")


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state_dict) whose inference forward multiplies by a copy of
    the weight that oneDNN reordered once (its op has no autograd). Whatever the copy cannot serve goes
    through ``F.linear``: anything autograd tracks (a trained weight, or an input that needs a gradient),
    autocast, another dtype or device. The copy is refreshed when the weight
    changes in place (an optimizer step bumps its version), so a drafter evaluated mid-training is
    never stale."""

    _packed: torch.Tensor
    _packed_version: int

    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.dtype != weight.dtype or x.device.type != "cpu" or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
                or torch.is_autocast_enabled("cpu")):
            return nn.functional.linear(x, weight, self.bias)
        if self._packed_version != weight._version:
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def _install_prepacked(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses may compute differently: left alone
            module.__class__ = PrepackedLinear
            module.pack()


def _uninstall_prepacked(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is PrepackedLinear:
            module.__class__ = nn.Linear
            del module._packed, module._packed_version


def _prepacked_applies(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


FORWARD_PATHS.register(EAGER)(ForwardPath(EAGER, lambda device, dtype: True, lambda model: None, lambda model: None))
FORWARD_PATHS.register("prepacked")(ForwardPath("prepacked", _prepacked_applies, _install_prepacked, _uninstall_prepacked,
                                                 lambda model: any(type(m) is PrepackedLinear for m in model.modules())))


def path_choices() -> list[str]:
    """What ``--forward-path`` accepts."""
    return [AUTO, *FORWARD_PATHS.names()]


def applicable_paths(device: torch.device, dtype: torch.dtype) -> list[str]:
    return [name for name in FORWARD_PATHS.names() if FORWARD_PATHS.get(name).applies(torch.device(device), dtype)]


def current_path(model: nn.Module) -> str:
    """The path a model runs on now (eager unless a path installed modules of its own)."""
    return next((name for name in FORWARD_PATHS.names() if FORWARD_PATHS.get(name).installed(model)), EAGER)


def use_path(model: nn.Module, name: str) -> None:
    """Switch ``model`` onto path ``name`` (uninstalling any other first); refused where it cannot apply."""
    param = next(model.parameters())
    path = FORWARD_PATHS.get(name)
    if not path.applies(param.device, param.dtype):
        raise SpecdraftError(f"--forward-path {name} does not apply to a {str(param.dtype).removeprefix('torch.')} model on "
                             f"{param.device.type} here; use one of {', '.join([AUTO, *applicable_paths(param.device, param.dtype)])}")
    for other in FORWARD_PATHS.names():
        if other != name:
            FORWARD_PATHS.get(other).uninstall(model)
    path.install(model)


@dataclass(frozen=True)
class PathChoice:
    """The path a model runs on and why: the flag, or ``auto`` with the measured (or cached) figures."""

    name: str
    source: str  # "flag" | "measured" | "cached" | "only" (a single applicable path: nothing to time)
    seconds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"forward_path": self.name, "forward_path_source": self.source, "forward_path_seconds": dict(self.seconds)}


def resolve_path(model: nn.Module, requested: str, what: str, context: dict[str, Any], work_seconds: Callable[[], float]) -> PathChoice:
    """Put ``model`` on ``requested``, or for ``auto`` on the applicable path whose ``work_seconds()`` (decode-
    shaped work on the model as it is now) was fastest, timed once per machine and ``context`` and cached."""
    if requested != AUTO:
        use_path(model, requested)
        return PathChoice(requested, "flag", {})
    param = next(model.parameters())
    names = applicable_paths(param.device, param.dtype)

    def timer(name: str) -> Callable[[], float]:
        def run() -> float:
            use_path(model, name)
            return work_seconds()

        return run

    measurement: Measurement = measured_choice(f"forward-path-{what}", context, {n: timer(n) for n in names}, preferred=EAGER,
                                               device=param.device)
    use_path(model, measurement.choice)
    source = "only" if len(names) == 1 else ("cached" if measurement.cached else "measured")
    return PathChoice(measurement.choice, source, dict(measurement.seconds))
