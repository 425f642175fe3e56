"""`kvbaton profile` on tiny-random: measures every step kind, fits, and writes a file the simulator loads."""

from __future__ import annotations

import json
from pathlib import Path

from kvbaton.cli import build_parser
from kvbaton.engine.profiler import QUICK_GRID, measure, run_profile
from kvbaton.sim.costs import BatchShape, create_cost_model


def test_profile_writes_coefficients_the_simulator_reads(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny.json"
    args = build_parser().parse_args(["profile", "--model", "tiny-random", "--dtype", "float32", "--quick",
                                      "--out", str(out)])
    assert run_profile(args) == 0
    assert "profiled tiny-random" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["fit_quality"]["prefill"]["num_samples"] >= 8
    assert payload["fit_quality"]["decode"]["num_samples"] >= 4
    model = create_cost_model(str(out), "tiny-random", "cpu")
    assert model.kv_bytes_per_token > 0
    # A fitted model is non-negative and grows with work.
    assert 0 < model.prefill_s(16) <= model.prefill_s(256)
    assert 0 < model.decode_s(1, 32) <= model.decode_s(8, 8 * 512)


def test_measured_steps_cover_cached_prefills_and_decode_batches() -> None:
    from kvbaton.core.config import CacheConfig, EngineConfig
    from kvbaton.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny-random", dtype="float32", cache=CacheConfig(num_blocks=512)))
    samples = measure(engine, QUICK_GRID)
    shapes = [s.shape for s in samples]
    assert any(s.prefill_new_tokens and s.prefill_context_tokens[0] == 64 for s in shapes)  # prefix-cache hit
    assert any(len(s.prefill_new_tokens) == 2 for s in shapes)  # two prefills in one step
    assert BatchShape(num_decodes=4, decode_context_tokens=4 * 129) in shapes  # first decode of 4 x 128-token prompts
    assert all(s.duration_s > 0 for s in samples)
