"""The simulator's hot-path RouteRequest constructor builds exactly what the dataclass constructor builds."""

from __future__ import annotations

from kvbaton.router.base import RouteRequest, make_route_request


def test_make_route_request_equals_the_constructor() -> None:
    built = make_route_request("r1", (5, 6), 40, 12)
    expected = RouteRequest("r1", (5, 6), 40, 12)
    assert built == expected and type(built) is RouteRequest and hash(built) == hash(expected)
    assert repr(built) == repr(expected)
