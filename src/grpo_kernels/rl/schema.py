"""The YAML schema machinery of ``TrainConfig``: typed conversion, dotted keys, sections.

A :class:`Section` validates itself on construction and names every bad field by its dotted
key (``rollout.num_generations``), so a bad config fails in its first second.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, Mapping


def fail(key: str, message: str) -> None:
    raise ValueError(f"{key}: {message}")


class Section:
    """Base of the config sections: ``__post_init__`` runs ``validate(KEY)``.

    ``KEY`` is the section's dotted key in a ``TrainConfig``; a section built inside a list
    (``rewards.functions[1]``) is re-keyed by :func:`build`.
    """

    KEY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate(self.KEY)

    def validate(self, key: str) -> None:
        del key


def set_dotted(values: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets ``values["a"]["b"] = value`` for ``dotted="a.b"``, creating mappings on the way."""
    parts = dotted.split(".")
    node = values
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


def choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(key, f"must be one of {list(choices)}, got {value!r}")


def positive(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fail(key, f"must be an int >= 1, got {value!r}")


def finite(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        fail(key, f"must be a finite number, got {value!r}")


def convert(t: Any, value: Any, key: str) -> Any:
    """``value`` checked against the annotation ``t`` (recursing into dataclasses)."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        # One type besides None is checked here; a wider union (``bool | Literal["hlo"]``)
        # is left to the dataclass's own ``__post_init__``.
        return convert(inner[0], value, key) if len(inner) == 1 else value
    if dataclasses.is_dataclass(t):
        if not isinstance(value, Mapping):
            fail(key, f"must be a mapping, got {type(value).__name__}")
        return build(t, value, key)
    if origin is tuple:
        (inner, _) = typing.get_args(t)
        if not isinstance(value, (list, tuple)):
            fail(key, f"must be a list, got {type(value).__name__}")
        return tuple(convert(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    if t is dict:
        if not isinstance(value, Mapping):
            fail(key, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, f"must be a number, got {value!r}")
        return float(value)
    if t is int and (isinstance(value, bool) or not isinstance(value, int)):
        fail(key, f"must be an int, got {value!r}")
    if t is bool and not isinstance(value, bool):
        fail(key, f"must be true or false, got {value!r}")
    if t is str and not isinstance(value, str):
        fail(key, f"must be a string, got {value!r}")
    return value


def build(cls: Any, values: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(values, Mapping):
        fail(prefix or "config", f"must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for name in values:
        if name not in known:
            where = f"{prefix}.{name}" if prefix else str(name)
            fail(where, f"unknown key; known keys here are {known}")
    kwargs = {name: convert(hints[name], v, f"{prefix}.{name}" if prefix else name)
              for name, v in values.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section validated under its KEY: name where it really is
        key = getattr(cls, "KEY", "")
        message = str(e)
        if key and prefix and key != prefix and message.startswith(key):
            message = prefix + message[len(key):]
        raise ValueError(message) from None


