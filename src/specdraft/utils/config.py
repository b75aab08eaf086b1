"""Typed configs as the single source of defaults and ``--help`` text.

Each concern declares a dataclass whose fields carry ``metadata={"help": ...}``; the CLI derives
its flags from it (``add_dataclass_arguments``) and builds the config back (``dataclass_from_args``),
so a default lives in exactly one place. Validation belongs in the dataclass ``__post_init__``, which
starts with ``require_finite(self)``: Python's ``float("nan")`` passes every ``< 0`` check, and a value
of the wrong type (a recipe's or ``--model key=value``'s YAML can give any) passes some checks and fails
others with a bare ``TypeError``, or none at all (a string where a bool belongs).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any, Callable, TypeVar

C = TypeVar("C")


#: ``auto`` and the paths of ``utils/forward_path.FORWARD_PATHS``, named here so configs stay torch-free (a test keeps them equal).
FORWARD_PATH_CHOICES = ("auto", "eager", "gqa", "prepacked", "prepacked+gqa", "prepacked+streamed", "prepacked+streamed+gqa")


def check_forward_path(value: str, flag: str = "forward_path") -> None:
    if value not in FORWARD_PATH_CHOICES:
        from specdraft.errors import SpecdraftError

        raise SpecdraftError(f"{flag} must be one of {', '.join(FORWARD_PATH_CHOICES)}, got {value!r}")


def config_field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text (list defaults are copied per instance)."""
    metadata = {"help": help, **kwargs.pop("metadata", {})}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


_SCALARS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _type_problem(tp: Any, value: Any) -> str | None:
    """What ``value`` should be for the scalar (or list of scalars) type ``tp``; None when it is, or when
    ``tp`` is anything else (those fields check themselves)."""
    if tp in _SCALARS:
        what, ok = _SCALARS[tp]
        return None if ok(value) else what
    if typing.get_origin(tp) is list and typing.get_args(tp) and typing.get_args(tp)[0] in _SCALARS:
        what, ok = _SCALARS[typing.get_args(tp)[0]]
        return None if isinstance(value, (list, tuple)) and all(map(ok, value)) else f"a list of {what.removeprefix('an ').removeprefix('a ')}s"
    return None


def require_finite(config: Any) -> None:
    """Refuse a value of the wrong type in every scalar (or scalar-list) field of a dataclass config, and
    NaN/inf in every float field (and float list), naming the field."""
    from specdraft.errors import SpecdraftError

    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        tp, _ = _unwrap_optional(hints.get(f.name, Any))
        problem = None if value is None else _type_problem(tp, value)
        if problem:
            raise SpecdraftError(f"{type(config).__name__}: {f.name} must be {problem}, got {value!r} ({_flag(f.name)})")
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = next((v for v in values if isinstance(v, float) and not math.isfinite(v)), None)
        if bad is not None:
            name = type(config).__name__
            raise SpecdraftError(f"{name}: {f.name} must be a finite number, got {bad} ({_flag(f.name)})")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """Add one ``--kebab-case`` flag per field of ``cls`` (bools become ``--flag/--no-flag``)."""
    hints = typing.get_type_hints(cls)
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only):  # inherited keyword-only option groups last
        if f.name in exclude or not f.init:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text + ("" if required else f" (default: {default})")}
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS
        if "choices" in f.metadata:  # a callable: names a registry holds once higher layers registered into it
            choices = f.metadata["choices"]
            kwargs["choices"] = choices() if callable(choices) else choices
        if tp is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(tp) in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            parser.add_argument(_flag(f.name), type=_list_parser(item), **kwargs)
        elif required and tp is str:
            parser.add_argument(_flag(f.name), type=_non_empty, **kwargs)
        else:
            parser.add_argument(_flag(f.name), type=tp if tp in (int, float, str) else str, **kwargs)


def _non_empty(text: str) -> str:
    """A required path or name: an empty one (an unset shell variable) would otherwise mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _list_parser(item: type):
    def parse(text: str) -> list:
        parts = [p for p in text.split(",") if p.strip()]
        try:
            return [item(p.strip()) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {item.__name__}, got {text!r}")

    return parse


def dataclass_from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Build ``cls`` from the parsed flags; fields whose flag was not given keep their defaults."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
