"""Deterministic fault injection for any `KVTransport`: scripted drops, delays, failures and peer kills.

`FaultyTransport` wraps a transport and consults its rules, in order, for every message it sends;
the first matching rule with uses left fires. Time comes from an injected clock, so a delay is
released by the first `send`/`poll`/`flush` at or after its due time — tests drive a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from kvbaton.transfer.base import Delivery, KVTransport, PeerLost, TransportError
from kvbaton.transfer.messages import LayerChunk, Message, TransferId


class InjectedFault(TransportError):
    """A failure a fault rule raised on purpose (the sending worker 'crashed' at that point)."""


class FaultAction(Enum):
    DROP = "drop"  # the message (and a chunk's bytes) never arrive
    DELAY = "delay"  # delivered `delay_s` later, after messages sent meanwhile
    FAIL_BEFORE = "fail_before"  # raise before anything of the message is sent
    FAIL_DURING = "fail_during"  # a chunk: deliver its first half of the positions, then raise
    FAIL_AFTER = "fail_after"  # deliver the message, then raise
    KILL_PEER = "kill_peer"  # drop the link to the peer (both ends see PeerLost), then raise


@dataclass(frozen=True, slots=True)
class FaultRule:
    action: FaultAction
    message_type: type | None = None  # e.g. LayerChunk; None matches every message
    layer_index: int | None = None  # only chunks of this layer
    transfer_id: TransferId | None = None
    delay_s: float = 0.0
    times: int = 1  # how many matching messages the rule hits

    def matches(self, message: Message) -> bool:
        if self.message_type is not None and not isinstance(message, self.message_type):
            return False
        if self.transfer_id is not None and message.transfer_id != self.transfer_id:
            return False
        if self.layer_index is not None:
            return isinstance(message, LayerChunk) and message.layer_index == self.layer_index
        return True


@dataclass(slots=True)
class _Delayed:
    due_at: float
    peer: str
    message: Message
    source_kv: np.ndarray | None


class FaultyTransport(KVTransport):
    def __init__(self, inner: KVTransport, rules: list[FaultRule], clock: Callable[[], float]) -> None:
        self.inner = inner
        self.name = inner.name
        self.clock = clock
        self._rules = list(rules)
        self._uses_left = [rule.times for rule in rules]
        self._delayed: list[_Delayed] = []
        self.fired: list[tuple[FaultAction, Message]] = []  # what happened, for test assertions

    def send(self, peer: str, message: Message, source_kv: np.ndarray | None = None) -> None:
        self.flush()
        rule = self._take_rule(message)
        if rule is None:
            self.inner.send(peer, message, source_kv)
            return
        self.fired.append((rule.action, message))
        if rule.action is FaultAction.DROP:
            return
        if rule.action is FaultAction.DELAY:
            self._delayed.append(_Delayed(self.clock() + rule.delay_s, peer, message, source_kv))
            return
        if rule.action is FaultAction.FAIL_BEFORE:
            raise InjectedFault(f"injected failure before {type(message).__name__}")
        if rule.action is FaultAction.FAIL_DURING:
            if isinstance(message, LayerChunk) and message.num_valid_tokens >= 2:
                self.inner.send(peer, _first_half(message), source_kv)
            raise InjectedFault(f"injected failure during {type(message).__name__}")
        if rule.action is FaultAction.FAIL_AFTER:
            self.inner.send(peer, message, source_kv)
            raise InjectedFault(f"injected failure after {type(message).__name__}")
        self.inner.disconnect(peer)
        raise InjectedFault(f"injected kill of the link to {peer}")

    def flush(self) -> None:
        """Send every delayed message whose time has come, in due order (ties: send order)."""
        now = self.clock()
        due = sorted((item for item in self._delayed if item.due_at <= now), key=lambda item: item.due_at)
        self._delayed = [item for item in self._delayed if item.due_at > now]
        for item in due:
            try:
                self.inner.send(item.peer, item.message, item.source_kv)
            except TransportError:
                pass  # the link died while the message was held: lost with it, as in flight on a real link

    def poll(self, timeout_s: float) -> list[Delivery | PeerLost]:
        self.flush()
        return self.inner.poll(timeout_s)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def close(self) -> None:
        self._delayed.clear()
        self.inner.close()

    def _take_rule(self, message: Message) -> FaultRule | None:
        for index, rule in enumerate(self._rules):
            if self._uses_left[index] > 0 and rule.matches(message):
                self._uses_left[index] -= 1
                return rule
        return None


def _first_half(chunk: LayerChunk) -> LayerChunk:
    num_tokens = chunk.num_valid_tokens // 2
    num_blocks = len(chunk.layout.block_range(chunk.first_position, num_tokens))
    return replace(chunk, num_valid_tokens=num_tokens, src_block_ids=chunk.src_block_ids[:num_blocks],
                   dst_block_ids=chunk.dst_block_ids[:num_blocks])
