"""Backends by name. roll never imports a backend module: it loads them lazily through the
``roll.backends`` entry-point group (see pyproject.toml), so the standard backend works with no
megatron-core installed."""

from __future__ import annotations

from importlib.metadata import entry_points

from roll.errors import ConfigError

_REGISTRY: dict[str, type] = {}


def register_backend(name: str):
    """Class decorator: make a Backend subclass available as ``name``. Refuses duplicates."""

    def decorator(cls: type) -> type:
        existing = _REGISTRY.get(name)
        # The same class defined again (its module re-imported) may re-register; any other class may not.
        if existing is not None and _qualified(existing) != _qualified(cls):
            raise ValueError(f"backend {name!r} is already registered by {_qualified(existing)}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return decorator


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def available_backends() -> list[str]:
    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group="roll.backends")})


def get_backend_class(name: str) -> type:
    """The Backend class registered as ``name``, importing its module on first use."""
    if name not in _REGISTRY:
        matches = [ep for ep in entry_points(group="roll.backends") if ep.name == name]
        if not matches:
            raise ConfigError(f"unknown backend {name!r}; available: {', '.join(available_backends()) or 'none'} "
                              "(is roll installed with `pip install -e .`?).")
        _REGISTRY.setdefault(name, matches[0].load())
    return _REGISTRY[name]
