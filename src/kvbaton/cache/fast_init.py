"""Build frozen slotted dataclass values on hot paths without their generated `__init__`, guarded against drift.

A frozen slotted dataclass's `__init__` writes each field through `object.__setattr__` (to get past
its own frozen `__setattr__`): about 0.15 us a field. The simulator builds tens of such values per
request (route requests, handoff messages, prefix matches, KV events), always from fields its own
code has already checked, so their modules build them with `object.__new__` plus the slots' member
descriptors instead (about half the time). The result is an ordinary instance of the class: equal,
hashing and printing as one built by `__init__`, and still frozen.

Only valid for a class without `__post_init__` (nothing to validate or derive) whose every field is
passed. `slot_setters` checks exactly that when the builder's module is imported, so a field added
to, removed from or reordered in a class fails loudly instead of leaving a slot unset. Values built
from external input (decoded wire messages, API calls) keep using the class's own constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

SlotSetter = Callable[[Any, Any], None]


def slot_setters(cls: type, field_names: tuple[str, ...]) -> tuple[SlotSetter, ...]:
    """The slot setters of `cls`'s fields, in `field_names` order, which must be all its fields in declaration order.

    Raises ImportError (it is called at import time) if `cls` is not a slotted dataclass, has a
    `__post_init__`, or its fields are not exactly `field_names`.
    """
    if not (is_dataclass(cls) and "__slots__" in cls.__dict__) or hasattr(cls, "__post_init__"):
        raise ImportError(f"{cls.__name__} is not a slotted dataclass without __post_init__: build it with __init__")
    actual = tuple(f.name for f in fields(cls))
    if actual != field_names:
        raise ImportError(f"fast constructor of {cls.__name__} is out of date: fields {actual}, builder {field_names}")
    return tuple(cls.__dict__[name].__set__ for name in field_names)
