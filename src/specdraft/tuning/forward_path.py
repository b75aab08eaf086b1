"""How a frozen model's forward runs on this machine: the exact execution paths' parts and the measured choice.

Why: on CPUs eager ``F.linear`` with a few rows (a verify block of 2-9 tokens) pays about twice a GEMV's memory
traffic; the same linear through oneDNN with its weight reordered once into oneDNN's blocked layout does not (part
``prepacked``), and it needs no compilation (``torch.compile`` with frozen weights prepacks the same way, after minutes
of compiling per shape). HF's SDPA attention copies every layer's K/V once per query head of a group on each masked
forward of more than one token (every verify forward), unless told to let SDPA group the heads itself (part ``gqa``).
And oneDNN's kernels for a few rows read the weights well below the machine's bandwidth, so part ``streamed`` sends
forwards of up to the row count measured to pay here through specdraft's own kernel (``tuning/streamed.py``; its
probe is :func:`stream_rows`). The figures behind these reasons, with their commands, are in
``docs/results/machine_tuning.md``.

Paths combine such parts (``prepacked+gqa``; the names live in ``tuning/paths.py``). Which path is faster depends on
the machine and the model, so ``auto`` times decode-shaped work on each applicable path once per machine and model
(``tuning/measured.py``), logs the figures and keeps the fastest; eager is preferred unless another is clearly faster.
A path changes how modules compute, never their parameters or state_dict, and every path is exact up to float
reassociation (logits within ``LOGIT_TOLERANCE`` of eager, tested).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn

from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry
from specdraft.tuning import streamed
from specdraft.tuning.measured import Measurement, measured_choice
from specdraft.tuning.paths import AUTO, EAGER, FORWARD_PATHS, ForwardPath

log = logging.getLogger(__name__)

#: Largest |logit - eager logit| a path may produce (fp32 reassociation; tests/test_forward_path.py holds tiny targets to it).
LOGIT_TOLERANCE = 2e-3


@dataclass(frozen=True)
class PathPart:
    """One change to how a model computes that paths combine: whether it can apply to a model (``fits``; ``needs``
    says what it needs, for errors), how to switch it on (``install``) and off (``uninstall``), both idempotent and
    in place, whether a model holds it now (``installed``) and, for a part that brings code of its own, that code's
    ``version``. An ``optional`` part that does not fit a model would
    change nothing there (no grouped attention to group): a path naming it runs without it instead of being refused."""

    name: str
    needs: str
    fits: Callable[[nn.Module], bool]
    install: Callable[[nn.Module], None]
    uninstall: Callable[[nn.Module], None]
    installed: Callable[[nn.Module], bool]
    optional: bool = False
    version: Callable[[], str] | None = None  # the part's own code (a kernel's source): cached timings of other code are stale


PATH_PARTS: Registry[PathPart] = Registry("forward path part")


def path_applies(path: ForwardPath, model: nn.Module) -> bool:
    """Whether every part of ``path`` fits ``model``."""
    return all(PATH_PARTS.get(part).fits(model) for part in path.parts)


def path_version(name: str) -> str:
    """``name`` plus the versions of its parts that carry code of their own (``prepacked+streamed@1a2b...``): what
    caches of timings on a path (the path probes, SPS profiles) are keyed by, so a changed kernel is measured again."""
    versions = [version() for part in FORWARD_PATHS.get(name).parts if (version := PATH_PARTS.get(part).version) is not None]
    return f"{name}@{'.'.join(versions)}" if versions else name


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

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the inference-only ops may compute ``self(x)``: not where autograd tracks the weight or the input,
        under autocast, or for another dtype or device."""
        return not (
            x.dtype != self.weight.dtype
            or x.device.type != "cpu"
            or torch.is_autocast_enabled("cpu")
            or (torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.serves(x):
            return nn.functional.linear(x, self.weight, self.bias)
        return self.inference(x)

    def inference(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` for an input ``serves`` accepted."""
        if self._packed_version != self.weight._version:
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


class StreamedLinear(PrepackedLinear):
    """A ``PrepackedLinear`` whose forwards of at most ``_stream_rows`` rows go through specdraft's streamed kernel
    (``tuning/streamed.py``), which reads the weight itself (no copy; it follows in-place updates by construction)."""

    _stream_rows: int

    def inference(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.shape[-1:] == (self.in_features,) else -1
        if 0 < rows <= self._stream_rows and self.weight.is_contiguous():
            out = streamed.streamed_linear(x.reshape(rows, self.in_features).contiguous(), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return super().inference(x)


_Module = TypeVar("_Module", bound=nn.Module)


def _set_class(module: nn.Module, cls: type[_Module]) -> _Module:
    """``module`` turned into a ``cls`` in place (same parameters and state, ``cls``'s forward): how each part installs
    and uninstalls itself without copying weights."""
    module.__class__ = cls
    return cast(_Module, module)  # the assignment made it one; a type checker cannot follow a class swap


def _install_prepacked(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses may compute differently: left alone
            _set_class(module, PrepackedLinear).pack()


def _uninstall_prepacked(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, PrepackedLinear):  # a StreamedLinear too: the part it refines goes with it
            _set_class(module, nn.Linear)
            for name in ("_packed", "_packed_version", "_stream_rows"):
                module.__dict__.pop(name, None)


def _prepacked_fits(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


#: Row counts part ``streamed`` is measured at (a verify forward of a 7-token block plus its anchor is 8 rows).
STREAM_PROBE_ROWS = 8
#: The streamed kernel takes a row count only where its pass was faster than oneDNN's by more than this share.
STREAM_MARGIN = 0.05


def stream_cap(streamed_s: dict[int, float], prepacked_s: dict[int, float], *, margin: float = STREAM_MARGIN) -> int:
    """The largest row count up to which every count ran faster streamed than prepacked (by ``margin``), from
    seconds per pass at each row count; 0 where one row already does not pay. E.g. streamed {1: 20, 2: 20, 3: 23,
    4: 35}, prepacked {1: 31, 2: 34, 3: 29, 4: 29} -> 3."""
    cap = 0
    for rows in sorted(streamed_s):
        if rows != cap + 1 or rows not in prepacked_s or streamed_s[rows] >= (1.0 - margin) * prepacked_s[rows]:
            break
        cap = rows
    return cap


def stream_rows(model: nn.Module) -> int:
    """Up to how many rows this model's prepacked linears run streamed here: a pass through all of them (the weights
    streaming from memory as in a forward) timed per row count 1..``STREAM_PROBE_ROWS`` on both kernels, once per
    machine and set of linear shapes, then cached (``tuning/measured.py``); ``stream_cap`` decides."""
    from specdraft.tuning.measured import fastest_time, measured_figures

    linears = [m for m in model.modules() if isinstance(m, PrepackedLinear) and m.weight.is_contiguous()]
    if not linears:
        return 0
    shapes = sorted({(m.in_features, m.out_features, m.bias is not None) for m in linears})

    def measure() -> dict[str, float]:
        for m in linears:
            if m._packed_version != m.weight._version:
                m.pack()
        figures = {}
        with torch.no_grad():
            for rows in range(1, STREAM_PROBE_ROWS + 1):
                inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in linears}}
                # timed within this iteration, so the closures' late binding of `inputs` is the intent
                passes = {
                    "streamed": lambda: [streamed.streamed_linear(inputs[m.in_features], m.weight, m.bias) for m in linears],  # noqa: B023
                    "prepacked": lambda: [
                        torch.ops.mkldnn._linear_pointwise(inputs[m.in_features], m._packed, m.bias, "none", [], "")  # noqa: B023
                        for m in linears
                    ],
                }
                for kernel, one_pass in passes.items():
                    figures[f"{kernel}/{rows}"] = fastest_time(one_pass, repeats=3)
        return figures

    def split(figures: dict[str, float]) -> tuple[dict[int, float], dict[int, float]]:
        by: dict[str, dict[int, float]] = {"streamed": {}, "prepacked": {}}
        for key, seconds in figures.items():
            kernel, _, rows = key.partition("/")
            by[kernel][int(rows)] = seconds
        return by["streamed"], by["prepacked"]

    figures, cached, path = measured_figures(
        "stream-rows",
        {"linears": shapes, "rows": STREAM_PROBE_ROWS, "kernel": streamed.kernel_version()},
        measure,
        decide=lambda f: stream_cap(*split(f)),
    )
    by_streamed, by_prepacked = split(figures)
    cap = stream_cap(by_streamed, by_prepacked)
    log.info(
        "streamed linears up to %d row(s) (%s in %s; ms per pass streamed/prepacked by rows: %s)",
        cap,
        "cached" if cached else "measured",
        path,
        ", ".join(f"{r} {by_streamed[r] * 1e3:.1f}/{by_prepacked[r] * 1e3:.1f}" for r in sorted(by_streamed)),
    )
    return cap


def _streamed_fits(model: nn.Module) -> bool:
    return _prepacked_fits(model) and streamed.streamed_ops() is not None


def _install_streamed(model: nn.Module) -> None:
    if _streamed_installed(model):
        return
    cap = stream_rows(model)
    for module in model.modules():
        if type(module) is PrepackedLinear:
            _set_class(module, StreamedLinear)._stream_rows = cap


def _uninstall_streamed(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is StreamedLinear:
            del _set_class(module, PrepackedLinear)._stream_rows


def _streamed_installed(model: nn.Module) -> bool:
    return any(type(m) is StreamedLinear for m in model.modules())


#: Whether the forward running in this context hands grouped K/V heads to SDPA (``enable_gqa``) even with a mask: set
#: by a model on part ``gqa`` around its own forward only, so other models (and other threads) keep HF's default.
#: Without it every masked forward of more than one token -- each verify forward of the runtime -- copies every layer's
#: whole K/V once per query head of a group (``repeat_kv``), a cost that grows with the context.
_GQA_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("specdraft_sdpa_gqa", default=False)


def _hook_sdpa_gqa() -> None:
    """Make HF's per-call test (``sdpa_attention.use_gqa_in_sdpa``) answer yes inside a ``gqa`` forward, once per
    process; HF's own answer stands everywhere else."""
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    if getattr(original, "specdraft_gqa", False):
        return

    def use_gqa_in_sdpa(attention_mask: Any, key: torch.Tensor, value: torch.Tensor) -> bool:
        return _GQA_ON.get() or original(attention_mask, key, value)

    use_gqa_in_sdpa.specdraft_gqa = True  # type: ignore[attr-defined]
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa


class _GqaForward:
    """A model's own forward run with grouped SDPA on for the call (:data:`_GQA_ON`, reset after)."""

    def __init__(self, forward: Callable[..., Any]):
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = _GQA_ON.set(True)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _GQA_ON.reset(token)


def _gqa_fits(model: nn.Module) -> bool:
    """An HF model on ``sdpa`` attention whose attention groups query heads over shared K/V heads."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) == "sdpa" and any(
        getattr(module, "num_key_value_groups", 1) > 1 for module in model.modules()
    )


def _install_gqa(model: nn.Module) -> None:
    if not _gqa_installed(model):
        _hook_sdpa_gqa()
        model.forward = _GqaForward(model.forward)  # an instance attribute: nn.Module.__call__ runs it


def _uninstall_gqa(model: nn.Module) -> None:
    if _gqa_installed(model):
        del model.forward


def _gqa_installed(model: nn.Module) -> bool:
    return isinstance(model.__dict__.get("forward"), _GqaForward)


PATH_PARTS.register("prepacked")(
    PathPart(
        "prepacked",
        "CPU fp32 with oneDNN",
        _prepacked_fits,
        _install_prepacked,
        _uninstall_prepacked,
        lambda model: any(isinstance(m, PrepackedLinear) for m in model.modules()),
    )
)
PATH_PARTS.register("streamed")(
    PathPart(
        "streamed",
        "CPU fp32 with oneDNN and a C++ compiler that builds specdraft's streamed linear (the log says why it did not)",
        _streamed_fits,
        _install_streamed,
        _uninstall_streamed,
        _streamed_installed,
        version=lambda: streamed.kernel_version(),  # noqa: PLW0108  (late-bound: a rebuilt or patched kernel's version)
    )
)
PATH_PARTS.register("gqa")(
    PathPart(
        "gqa",
        "a Hugging Face model on sdpa attention with grouped K/V heads",
        _gqa_fits,
        _install_gqa,
        _uninstall_gqa,
        _gqa_installed,
        optional=True,
    )
)


def applicable_paths(model: nn.Module) -> list[str]:
    return [name for name in FORWARD_PATHS.names() if path_applies(FORWARD_PATHS.get(name), model)]


def current_path(model: nn.Module) -> str:
    """The path a model runs on now (eager unless parts of another are installed)."""
    installed = {name for name in PATH_PARTS.names() if PATH_PARTS.get(name).installed(model)}
    return next((name for name in FORWARD_PATHS.names() if set(FORWARD_PATHS.get(name).parts) == installed), EAGER)


def use_path(model: nn.Module, name: str) -> str:
    """Switch ``model`` onto path ``name`` (the parts it names on, every other part off) and return the path it is on:
    ``name`` less the optional parts that do not fit this model. Refused where a required part cannot apply."""
    parts = FORWARD_PATHS.get(name).parts
    missing = [PATH_PARTS.get(part).needs for part in parts if not PATH_PARTS.get(part).fits(model) and not PATH_PARTS.get(part).optional]
    if missing:
        param = next(model.parameters())
        raise SpecdraftError(
            f"{setting('forward_path')} {name} does not apply to a {str(param.dtype).removeprefix('torch.')} model on "
            f"{param.device.type} here (it needs {'; '.join(missing)}); "
            f"use one of {', '.join([AUTO, *applicable_paths(model)])}"
        )
    kept = [part for part in parts if PATH_PARTS.get(part).fits(model)]
    for part in PATH_PARTS.names():
        if part not in kept:
            PATH_PARTS.get(part).uninstall(model)
    for part in kept:
        PATH_PARTS.get(part).install(model)
    return current_path(model)


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
        return PathChoice(use_path(model, requested), "flag", {})
    param = next(model.parameters())
    names = applicable_paths(model)

    def timer(name: str) -> Callable[[], float]:
        def run() -> float:
            use_path(model, name)
            return work_seconds()

        return run

    context = {**context, "paths": [path_version(n) for n in names]}
    measurement: Measurement = measured_choice(
        f"forward-path-{what}", context, {n: timer(n) for n in names}, preferred=EAGER, device=param.device
    )
    use_path(model, measurement.choice)
    source = "only" if len(names) == 1 else ("cached" if measurement.cached else "measured")
    return PathChoice(measurement.choice, source, dict(measurement.seconds))
