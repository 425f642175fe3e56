"""The guarded constructor bypass: values equal to the dataclass constructor's, and field-list drift fails at import."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import pytest

from kvbaton.cache.events import KVEvent, KVEventKind, make_kv_event
from kvbaton.cache.fast_init import slot_setters
from kvbaton.cache.radix_node import PrefixMatch, make_prefix_match


@dataclass(frozen=True, slots=True)
class _Pair:
    left: int
    right: str = "x"


@dataclass(frozen=True, slots=True)
class _Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")


@dataclass(frozen=True)
class _Unslotted:
    value: int


def test_setters_build_a_frozen_value_equal_to_the_constructors() -> None:
    set_left, set_right = slot_setters(_Pair, ("left", "right"))
    pair = object.__new__(_Pair)
    set_left(pair, 3)
    set_right(pair, "y")
    assert pair == _Pair(3, "y") and hash(pair) == hash(_Pair(3, "y")) and repr(pair) == repr(_Pair(3, "y"))
    with pytest.raises(FrozenInstanceError):
        pair.left = 4  # type: ignore[misc]


@pytest.mark.parametrize("names", [("left",), ("right", "left"), ("left", "right", "extra"), ("left", "middle")])
def test_a_field_list_that_differs_from_the_class_fails(names: tuple[str, ...]) -> None:
    with pytest.raises(ImportError, match="out of date"):
        slot_setters(_Pair, names)


def test_classes_that_validate_or_have_no_slots_are_refused() -> None:
    with pytest.raises(ImportError, match="__post_init__"):
        slot_setters(_Checked, ("value",))
    with pytest.raises(ImportError, match="slotted"):
        slot_setters(_Unslotted, ("value",))


def test_kv_event_and_prefix_match_builders_equal_the_constructors() -> None:
    event = make_kv_event(7, KVEventKind.STORED, (11, 12), 5, 16)
    assert event == KVEvent(7, KVEventKind.STORED, (11, 12), 5, 16) and type(event) is KVEvent
    assert KVEvent.from_wire(event.to_wire()) == event
    node = object()
    match = make_prefix_match((3, 4), (21, 22), node)
    assert match == PrefixMatch((3, 4), (21, 22), node) and match.num_blocks == 2
    assert hash(match) == hash(PrefixMatch((3, 4), (21, 22), node))
