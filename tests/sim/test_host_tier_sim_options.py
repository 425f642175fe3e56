"""Regressions found by bug hunting: the simulator's host KV tier.

Each test failed on the code it was written against; the fix it guards is named in its comment.
"""

from __future__ import annotations

import pytest

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.run import SimSetup, check_setup


def test_check_setup_refuses_a_host_tier_without_the_prefix_cache() -> None:
    # Was a bug (sim/run.py `check_setup`): `kvbaton sim --host-kv-gb 4 --no-prefix-cache` passed the up-front check
    # and was refused only once the workload was built, by CacheConfig, naming `host_num_blocks` (1907, the converted
    # size) rather than the option given. Fixed: check_setup refuses the combination, in the option's own terms.
    setup = SimSetup(model="llama-3-8b", gpu="h100", cluster="1xmixed", host_kv_gb=4.0, enable_prefix_cache=False)
    with pytest.raises(InvalidRequestError) as refused:
        check_setup(setup)
    assert str(refused.value) == "host_kv_gb 4 needs the prefix cache (it holds what the prefix cache evicts)"
