"""Drafter classes by speculative method: each class registers itself against the method table.

``register`` refuses a class whose ``method`` is not in ``spec_methods.METHODS`` or that another
class already claims, so the table and the classes cannot drift apart; ``drafters/factory.py``
imports the drafter modules (which registers their classes) and builds whatever class is
registered for the configured method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from warmcap.spec_methods import METHODS, spec_method

if TYPE_CHECKING:
    from warmcap.drafters.base import BaseDrafter

D = TypeVar("D", bound="type[BaseDrafter]")

_CLASSES: dict[str, type[BaseDrafter]] = {}


def register(cls: D) -> D:
    """Class decorator: ``cls`` drafts for the table method named by its ``method``."""
    method = spec_method(cls.method).name
    other = _CLASSES.get(method)
    if other is not None and other is not cls:
        raise TypeError(f"{cls.__name__} and {other.__name__} both register speculative method {method!r}")
    _CLASSES[method] = cls
    return cls


def drafter_class(method: str) -> type[BaseDrafter]:
    """The drafter class registered for ``method`` (a table method without one is a bug)."""
    cls = _CLASSES.get(spec_method(method).name)
    if cls is None:
        raise LookupError(f"speculative method {method!r} has no registered drafter class")
    return cls


def registered_methods() -> tuple[str, ...]:
    """Methods with a registered class, in table order."""
    return tuple(m for m in METHODS if m in _CLASSES)
