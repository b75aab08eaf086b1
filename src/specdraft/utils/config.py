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
import collections.abc
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def check_forward_path(value: str, flag: str = "forward_path") -> None:
    """Refuse a forward path no one registered (``tuning/paths.py`` is torch-free: configs check without loading torch)."""
    from specdraft.tuning.paths import path_choices

    if value not in path_choices():
        from specdraft.errors import SpecdraftError

        raise SpecdraftError(f"{flag} must be one of {', '.join(path_choices())}, got {value!r}")


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
    """What ``value`` should be to be of type ``tp`` ("an integer", "a list of numbers", "a mapping", "one of 'a', 'b'"),
    None when it is. ``None`` is one only for an ``Optional`` field; a class this does not know passes (such a
    field checks itself)."""
    tp, optional = _unwrap_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return None
    if tp is type(None):
        return None if value is None else "null"
    if origin in (typing.Union, types.UnionType):
        problems = [problem for arm in args if (problem := _type_problem(arm, value)) is not None]
        return None if len(problems) < len(args) else " or ".join(dict.fromkeys(problems))
    if value is None:
        return None if optional else "set (not null)"
    if tp in _SCALARS:
        what, ok = _SCALARS[tp]
        return None if ok(value) else what
    if origin is typing.Literal:
        return None if value in args else "one of " + ", ".join(map(repr, args))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = [m.value for m in tp]
        return None if isinstance(value, tp) or value in choices else "one of " + ", ".join(map(repr, choices))
    if tp in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return "a list"
        problem = next((p for v in value if (p := _type_problem(args[0] if args else Any, v))), None)
        return None if problem is None else f"a list of {_plural(problem)}"
    if tp is dict or origin in (dict, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            return "a mapping (key: value)"
        key_type, value_type = args or (Any, Any)
        for key, item in value.items():
            if problem := _type_problem(key_type, key):
                return f"a mapping whose keys are each {problem}"
            if problem := _type_problem(value_type, item):
                return f"a mapping whose values are each {problem}"
        return None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return None if isinstance(value, tp) else f"a {tp.__name__}"
    return None


def _plural(what: str) -> str:
    return what.removeprefix("an ").removeprefix("a ") + "s"


def require_finite(config: Any) -> None:
    """Refuse a value of the wrong type in every field of a dataclass config (``_type_problem``), and NaN/inf in
    every float field (and float list), naming the field (and its flag, where the running command has one)."""
    from specdraft.errors import SpecdraftError, setting

    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        problem = None if value is None else _type_problem(hints.get(f.name, Any), value)
        flag = setting(f.name)
        flag = f" ({flag})" if flag.startswith("--") else ""
        if problem:
            raise SpecdraftError(f"{type(config).__name__}: {f.name} must be {problem}, got {value!r}{flag}")
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = next((v for v in values if isinstance(v, float) and not math.isfinite(v)), None)
        if bad is not None:
            name = type(config).__name__
            raise SpecdraftError(f"{name}: {f.name} must be a finite number, got {bad}{flag}")


def check_fields(cls: type, values: Any, where: str, prefix: str = "") -> None:
    """Check a mapping read from a file (a YAML recipe, a JSON record) against the dataclass ``cls`` before it is
    built: the keys must be fields of ``cls`` and each value of its field's type, nested dataclasses recursively
    (``prefix`` is the key path so far). Without this a wrong type surfaces as a bare ``TypeError``/``ValueError``
    from whatever first touches it; here it is refused naming ``where``, the key path, the expected type and
    the value. ``None`` passes only an ``Optional`` field."""
    from specdraft.errors import SpecdraftError

    if not isinstance(values, collections.abc.Mapping):
        raise SpecdraftError(
            f"{where}: {prefix.removesuffix('.') or 'the file'} must be a mapping of {cls.__name__} fields, "
            f"got {values!r} ({type(values).__name__})"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(str(key) for key in values if key not in names)
    if unknown:
        raise SpecdraftError(
            f"{where}: unknown field(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid fields{' of ' + prefix.removesuffix('.') if prefix else ''}: {', '.join(sorted(names))}"
        )
    for key, value in values.items():
        tp, _ = _unwrap_optional(hints.get(key, Any))
        if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, collections.abc.Mapping):
            check_fields(tp, value, where, f"{prefix}{key}.")
            continue
        problem = _type_problem(hints.get(key, Any), value)
        if problem:
            raise SpecdraftError(f"{where}: {prefix}{key} must be {problem}, got {value!r} ({type(value).__name__})")


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
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only is True):  # inherited keyword-only option groups last
        if f.name in exclude or not f.init:
            continue
        tp, _ = _unwrap_optional(hints[f.name])
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        factory = f.default_factory
        default = f.default if f.default is not dataclasses.MISSING else None if factory is dataclasses.MISSING else factory()
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


def _list_parser(item: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [p for p in text.split(",") if p.strip()]
        try:
            return [item(p.strip()) for p in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {item.__name__}, got {text!r}") from None

    return parse


def dataclass_from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Build ``cls`` from the parsed flags; fields whose flag was not given keep their defaults."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
