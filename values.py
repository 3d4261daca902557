"""One coercer for every ``KEY=VALUE`` a user gives: model overrides and run settings alike.

A value arrives as a string (a flag, ``--override hidden_size=64``) or already typed (a YAML
file); either way it is checked against the field's annotation and converted, or rejected with
a ``UserError`` naming where it came from.
"""

from __future__ import annotations

import types
import typing

from shardzoo.errors import UserError

_WANTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _parse(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def coerce(value, tp, where: str, error=UserError):
    """``value`` as the annotation ``tp`` says (``int``, ``float | None``, ``tuple[str, ...]``,
    ...); strings are parsed as YAML scalars first. ``where`` names the setting in errors."""
    origin, args = typing.get_origin(tp), [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        if len(args) > 1:  # e.g. int | tuple[int, ...]: the first type that takes it
            for arg in args:
                try:
                    return coerce(value, arg, where, error)
                except UserError:
                    continue
            raise error(f"{where}: {value!r} is not a valid value")
        return coerce(value, args[0], where, error)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise error(f"{where}: expected a string, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            parsed = _parse(value)
            value = parsed if isinstance(parsed, list) else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise error(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else str
        return tuple(coerce(v, item, where, error) for v in value)
    if isinstance(value, str) and tp in (bool, int, float):
        if tp is float:  # YAML 1.1 reads "1e-6" as a string; Python's float does not
            try:
                return float(value)
            except ValueError:
                pass
        value = _parse(value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and number and float(value).is_integer():
        return int(value)
    if tp is float and number:
        return float(value)
    if tp in _WANTED:
        raise error(f"{where}: expected {_WANTED[tp]}, got {value!r}")
    if isinstance(value, str):  # an annotation without a check here (bare tuple, dict): parsed
        return _parse(value)
    return value


SEED_LIMIT = 2**32  # numpy's and jax's seeds: unsigned 32-bit


def check_seed(value, flag: str = "--seed", error=UserError) -> int:
    """A seed as numpy and jax take it: an integer in [0, 2**32)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise error(f"{flag} {value!r} must be an integer from 0 to {SEED_LIMIT - 1}")
    return value


def seed_arg(text: str) -> int:
    """argparse ``type`` of a seed flag (its error becomes the parser's one-line message)."""
    import argparse

    try:
        return check_seed(int(text), "seed")
    except (ValueError, UserError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer from 0 to {SEED_LIMIT - 1}") from None
