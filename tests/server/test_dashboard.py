"""The dashboard's page and data (server/dashboard.py, server/recent.py): the page is open and holds no data; the
data is an admin route; each worker's row and the router's recent traffic come out as the page reads them."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.auth import ADMIN, USER, ApiAuth, ApiKeys, Principal
from kvbaton.server.dashboard import dashboard_data
from kvbaton.server.recent import RecentWindow, percentile
from tests.server.api_fakes import FakeCluster


def test_the_page_is_open_and_its_data_needs_an_admin_key(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    auth = ApiAuth(ApiKeys([("sk-admin", Principal("", ADMIN)), ("sk-user", Principal("t", USER))]))
    with TestClient(create_app(cluster, tokenizer, "tiny-random", max_model_len=256, auth=auth)) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/dashboard/data" in page.text and "fake-0" not in page.text
        assert client.get("/dashboard/data").status_code == 401
        assert client.get("/dashboard/data", headers={"Authorization": "Bearer sk-user"}).status_code == 403
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                    headers={"Authorization": "Bearer sk-user"})
        data = client.get("/dashboard/data", headers={"Authorization": "Bearer sk-admin"}).json()
    (worker,) = data["workers"]
    assert worker["worker_id"] == "fake-0" and worker["role"] == worker["pool"] == "mixed"
    assert worker["num_waiting"] == 1 and worker["kv_cache_usage"] == 0.25
    assert (worker["tensor_parallel_size"], worker["pipeline_parallel_size"]) == (1, 1)  # none reported: one rank
    assert data["recent"]["num_finished"] == 1 and data["recent"]["ttft_s"]["p50"] is not None
    assert data["recent"]["itl_s"]["p99"] is not None and data["model"] == "tiny-random"


def test_a_lent_worker_shows_the_pool_it_serves() -> None:
    info = {"workers": [{"worker_id": "p0", "role": "prefill", "num_used_blocks": 4, "num_blocks": 8,
                         "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                         "prefix_cache_queries_tokens": 40, "prefix_cache_hits_tokens": 10,
                         "transfers": {"num_live": 2}, "spec_decode": {"num_draft_tokens": 9, "num_accepted_tokens": 3},
                         "kv_store": {"num_loaded_blocks": 5}, "num_cached_blocks": 4}],
            "lent_workers": {"p0": "prefill"}, "num_rejected": 2}
    data = dashboard_data(info, RecentWindow().summary(0.0), "m")
    (row,) = data["workers"]
    assert (row["pool"], row["prefix_hit_ratio"], row["num_transfers_in_flight"]) == ("mixed", 0.25, 2)
    assert (row["num_device_cached_blocks"], row["num_store_loaded_blocks"]) == (4, 5)
    assert (row["num_accepted_tokens"], row["num_draft_tokens"], data["num_rejected"]) == (3, 9, 2)
    assert (row["tensor_parallel_size"], row["pipeline_parallel_size"]) == (2, 1)


def test_the_window_forgets_what_is_older_and_ranks_the_rest() -> None:
    window = RecentWindow(window_s=60.0)
    for second in range(100):
        window.on_first_token(float(second), second / 100)
        window.on_finished(float(second))
    window.on_tokens(99.0, 4, 0.2)  # four tokens sharing 0.2 s
    window.on_refusal(10.0, "rejected")
    window.on_refusal(90.0, "rejected")
    summary = window.summary(100.0)
    assert summary.num_finished == 60 and summary.requests_per_s == 1.0  # seconds 40..99
    assert summary.ttft_s == {"p50": 0.69, "p90": 0.93, "p99": 0.99}
    assert summary.itl_s["p50"] == 0.05 and summary.refusals == {"rejected": 1}
    assert percentile([], 0.5) is None and percentile([1.0, 2.0], 0.5) == 1.0


def test_the_window_keeps_the_newest_observations_beyond_its_bound_and_drops_old_ones() -> None:
    window = RecentWindow(window_s=10.0, max_num_observations=3)
    for at, gap in ((1.0, 0.1), (2.0, 0.2), (3.0, 0.3), (4.0, 0.4), (5.0, 0.5)):
        window.on_tokens(at, 1, gap)
    assert window.summary(now=5.0).itl_s["p50"] == 0.4  # 0.3, 0.4, 0.5 are left: the bound drops the oldest
    assert window.summary(now=14.5).itl_s == {"p50": 0.5, "p90": 0.5, "p99": 0.5}  # 3.0 and 4.0 left the window
    assert window.summary(now=30.0).itl_s["p50"] is None
    window.on_tokens(31.0, 2, 0.8)
    assert window.summary(now=31.0).itl_s["p50"] == 0.4
