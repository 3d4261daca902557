"""The model zoo: ``get_model(name, **overrides) -> (module, config)`` and ``list_models()``.

A config pairs an architecture record with an execution record (``models/config.py``); presets
are registered by the family modules (``models/mlp.py``, ``models/hf/*.py``).
"""

from __future__ import annotations

import importlib

from shardzoo.errors import UserError
from shardzoo.values import coerce

_FAMILY_MODULES = ("shardzoo.models.mlp", "shardzoo.models.hf.registry")
_REGISTRY: dict = {}


class ModelError(UserError):
    """An unknown model name or a bad override the user gave."""


DTYPES = ("float32", "bfloat16", "float16")


def check_fields(config, choices: dict, positive=(), error=ModelError) -> None:
    """Raise ``error`` naming the first field of ``config`` outside its ``choices``, or one of
    ``positive`` that is set (not None) and not an integer > 0; called when a config is built."""
    where = type(config).__name__
    for name, allowed in choices.items():
        value = getattr(config, name)
        if not isinstance(value, str) or value not in allowed:
            raise error(f"{where}.{name}={value!r} is not one of {', '.join(allowed)}")
    for name in positive:
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise error(f"{where}.{name}={value!r} must be a positive integer")


def register(name: str, config) -> None:
    """Register a named preset: a config (``models/config.py``) whose ``build()`` returns the module."""
    if name in _REGISTRY and _REGISTRY[name] != config:
        raise ImportError(f"two model presets are named {name!r}")
    _REGISTRY[name] = config


def _load_families() -> None:
    for mod in _FAMILY_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def list_models() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def get_config(name: str, **overrides):
    """The preset's config with ``overrides`` applied (strings are parsed to the field's type)."""
    _load_families()
    if name not in _REGISTRY:
        raise ModelError(f"unknown model {name!r}; models: {', '.join(sorted(_REGISTRY))}")
    config = _REGISTRY[name]
    return apply_overrides(config, overrides, where=f"model {name!r}")


def get_model(name: str, **overrides):
    """``(module, config)`` for a registered preset, varied by ``overrides``."""
    config = get_config(name, **overrides)
    return config.build(), config


def apply_overrides(config, overrides: dict, where: str = "config"):
    """``config.replace`` of fields of either record by name, unknown keys reported and string
    values parsed to the field's type."""
    if not overrides:
        return config
    types = config.field_types()
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        import difflib

        near = {k: difflib.get_close_matches(k, types, n=1) for k in unknown}
        if all(near.values()):  # typos: name the field meant instead of listing them all
            raise ModelError(f"{where}: unknown override " + ", ".join(
                f"{k} (did you mean {near[k][0]}?)" for k in unknown))
        raise ModelError(f"{where}: unknown override {', '.join(unknown)}; fields: {', '.join(sorted(types))}")
    values = {k: coerce(v, types[k][1], f"{where}: override {k}", ModelError) for k, v in overrides.items()}
    try:
        return config.replace(**values)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None


def parse_overrides(items) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` from the command line to a dict."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ModelError(f"--override {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out
