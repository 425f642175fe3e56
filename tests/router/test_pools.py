"""Adaptive pools: when the balancer lends a worker to mixed duty and takes it back, and where requests go."""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.router.admission import AdmissionRequest, AdmissionSLO, DecodeLoad, DecodeSlot, PrefillLoad
from kvbaton.router.pools import Placement, PoolBalancer, PoolConfig


class Model:
    """1 ms per prompt token; a decode step of 10 ms + 1 ms per sequence."""

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return 1e-3 * new_tokens

    def decode_s(self, num_seqs: int, context_tokens: int) -> float:
        return 0.01 + 1e-3 * num_seqs


CONFIG = PoolConfig(high_pressure=1.0, low_pressure=0.5, sustain_s=2.0, cooldown_s=5.0)
POOLS = {"prefill": ["p0", "p1"], "decode": ["d0"]}


def balancer(config: PoolConfig = CONFIG) -> PoolBalancer:
    return PoolBalancer(AdmissionSLO(ttft_s=1.0, tpot_s=0.05), {}, Model(), config)


def test_lends_the_least_loaded_idle_worker_only_after_the_imbalance_holds_and_returns_it_when_calm() -> None:
    b = balancer()
    assert b.observe(0.0, 0.2, 3.0, POOLS) is None  # decode queues, prefill idles: not for long enough yet
    assert b.observe(1.9, 0.2, 3.0, POOLS) is None
    switch = b.observe(2.0, 0.2, 3.0, POOLS)
    assert switch is not None and (switch.worker_id, switch.role, switch.lent) == ("p0", "prefill", True)
    assert b.lent == {"p0": "prefill"}
    # Still imbalanced, but max_lent_per_pool is 1 and the cooldown runs.
    assert b.observe(10.0, 0.2, 3.0, POOLS) is None and b.observe(20.0, 0.2, 3.0, POOLS) is None
    assert b.observe(21.0, 0.2, 0.3, POOLS) is None  # decode calm: held 2 s before p0 goes home
    back = b.observe(23.0, 0.2, 0.3, POOLS)
    assert back is not None and (back.worker_id, back.lent) == ("p0", False) and b.lent == {}
    assert [s.lent for s in b.switches] == [True, False]


def test_a_blip_does_not_switch_and_a_lent_worker_goes_home_at_once_when_its_own_pool_queues() -> None:
    b = balancer()
    b.observe(0.0, 0.2, 3.0, POOLS)
    b.observe(1.0, 0.2, 0.8, POOLS)  # the imbalance broke: its clock restarts
    assert b.observe(2.5, 0.2, 3.0, POOLS) is None and b.observe(4.4, 0.2, 3.0, POOLS) is None
    assert b.observe(4.5, 0.2, 3.0, POOLS) is not None
    home = b.observe(4.6, 1.5, 3.0, POOLS)  # the prefill pool itself now queues: no cooldown for this
    assert home is not None and not home.lent and "prefill pool is under pressure" in home.reason


def test_prefill_pressure_lends_a_decode_worker() -> None:
    b = balancer(PoolConfig(sustain_s=0.0, cooldown_s=0.0))
    switch = b.observe(0.0, 2.0, 0.1, {"prefill": ["p0"], "decode": ["d1", "d0"]})
    assert switch is not None and (switch.worker_id, switch.role) == ("d1", "decode")


def test_pressure_is_the_least_loaded_workers_prediction_over_the_slo() -> None:
    b = balancer()
    request = AdmissionRequest("r", 200, 10)
    assert b.prefill_pressure(request, [PrefillLoad("p0", 1800), PrefillLoad("p1", 300)]) == pytest.approx(0.5)
    busy = DecodeLoad("d0", tuple(DecodeSlot(100, 50) for _ in range(39)), (), 1_000_000)
    assert b.decode_pressure(request, [busy]) == pytest.approx((0.01 + 0.04) / 0.05)
    on_their_way = DecodeLoad("d0", (), busy.decoding, 1_000_000)  # still prefilling: they will decode there
    assert b.decode_pressure(request, [on_their_way]) == pytest.approx((0.01 + 0.04) / 0.05)
    assert b.prefill_pressure(request, []) == 0.0 and b.decode_pressure(request, []) == 0.0


def test_choose_takes_the_whole_option_only_when_it_is_predicted_better() -> None:
    b = balancer()
    request = AdmissionRequest("r", 100, 50)
    pair, whole = Placement("p0", "d0"), Placement("p1", "p1")
    assert whole.whole and not pair.whole
    crowded = DecodeLoad("d0", tuple(DecodeSlot(100, 50) for _ in range(60)), (), 1_000_000)
    quiet_p1 = DecodeLoad("p1", (), (), 1_000_000)
    idle_p0, idle_p1 = PrefillLoad("p0", 0), PrefillLoad("p1", 0)
    assert b.choose([(pair, request, idle_p0, crowded), (whole, request, idle_p1, quiet_p1)], 0.0) == whole
    calm = DecodeLoad("d0", (), (), 1_000_000)
    assert b.choose([(pair, request, idle_p0, calm), (whole, request, idle_p1, quiet_p1)], 0.0) == pair  # a tie
    with pytest.raises(InvalidRequestError):
        b.choose([], 0.0)


def test_config_is_validated() -> None:
    with pytest.raises(InvalidRequestError):
        PoolConfig(high_pressure=0.5, low_pressure=0.5)
    with pytest.raises(InvalidRequestError):
        PoolConfig(max_lent_per_pool=0)


def test_route_prices_the_pair_on_the_best_workers_and_sends_whole_to_a_lent_one_when_better() -> None:
    b = balancer(PoolConfig(sustain_s=0.0, cooldown_s=0.0))
    crowded = tuple(DecodeSlot(100, 50) for _ in range(60))
    prefill = {"p0": PrefillLoad("p0", 0), "p1": PrefillLoad("p1", 500)}
    decode = {"d0": DecodeLoad("d0", crowded, (), 1_000_000), "p0": DecodeLoad("p0", (), (), 1_000_000),
              "p1": DecodeLoad("p1", (), (), 1_000_000)}
    request = AdmissionRequest("r", 100, 50)
    lent, switch = b.route(request, {}, ["p0", "p1"], ["d0"], prefill.__getitem__, decode.__getitem__, 0.0)
    assert switch is not None and switch.worker_id == "p0"  # the least loaded prefill worker is lent ...
    assert lent == "p0"  # ... and, its decode batch empty, beats the crowded pair at once
    # p1 holds the whole prompt in its cache but is not lent: the pair still prices on p0 (least TTFT).
    lent, _ = b.route(request, {"p1": 100}, ["p0", "p1"], ["d0"], prefill.__getitem__, decode.__getitem__, 0.1)
    assert lent == "p0"
    assert b.route(request, {}, [], ["d0"], prefill.__getitem__, decode.__getitem__, 0.2) == (None, None)
