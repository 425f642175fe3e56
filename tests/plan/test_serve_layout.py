"""`kvbaton plan --json` as `kvbaton serve --placement`'s pools (plan/serve_layout.py): counts, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.plan.serve_layout import PoolLayout, read_serve_layout, serve_command, serve_layout


def _unit(prefill: tuple[int, int, int] | None = None, decode: tuple[int, int, int] | None = None,
          colocated: tuple[int, int, int] | None = None, **extra: object) -> dict[str, object]:
    def pool(tp_pp_replicas: tuple[int, int, int]) -> dict[str, int]:
        tp, pp, replicas = tp_pp_replicas
        return {"tp": tp, "pp": pp, "replicas": replicas}

    unit: dict[str, object] = dict(extra)
    if colocated is not None:
        unit["colocated"] = pool(colocated)
    else:
        assert prefill is not None and decode is not None
        unit.update(prefill=pool(prefill), decode=pool(decode))
    return unit


def _plan(best: dict[str, object], **others: dict[str, object]) -> dict[str, object]:
    return {"best": best, "best_disaggregated": None, "best_colocated": None, **others,
            "settings": {"model": "smollm2-135m", "gpu": "a100"}}


def test_pools_are_replicas_times_units() -> None:
    layout = serve_layout(_plan(_unit((1, 1, 2), (1, 1, 1), units=2)))
    assert (layout.prefill, layout.decode, layout.mixed) == (PoolLayout(4), PoolLayout(2), None)
    assert layout.serve_flags() == ["--prefill", "4", "--decode", "2"] and layout.num_workers == 6
    assert (layout.planned_model, layout.planned_gpu) == ("smollm2-135m", "a100")
    colocated = serve_layout(_plan(_unit((1, 1, 1), (1, 1, 1)), best_colocated=_unit(colocated=(1, 1, 3))),
                             "best_colocated")
    assert colocated.mixed == PoolLayout(3) and colocated.serve_flags() == ["--workers", "3"]


@pytest.mark.parametrize("plan, pick, message", [
    (_plan(_unit((1, 1, 1), (1, 1, 1))), "best_colocated", "the plan has no best_colocated placement"),
    (_plan(_unit((1, 1, 1), (1, 1, 1))), "worst", "pick must be one of best, best_disaggregated"),
    (_plan(_unit((1, 1, 0), (1, 1, 1))), "best", "best: prefill.replicas must be a positive integer, got 0"),
    (_plan(_unit((1, 1, 1), (1, 1, 1), units=0)), "best", "best.units must be a positive integer"),
    (_plan({"prefill": {"tp": 1, "pp": 1, "replicas": 1}}), "best", "the decode pool is missing"),
    ({"candidates": []}, "best", "not a `kvbaton plan --json` answer"),
])
def test_what_cannot_launch_is_refused_with_the_reason(plan: dict[str, object], pick: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        serve_layout(plan, pick)


def test_parallel_pools_map_to_the_serve_flags_of_their_degrees() -> None:
    # DistServe's placement for its case: prefill TP2 + decode TP1.
    layout = serve_layout(_plan(_unit((2, 1, 1), (1, 1, 1))))
    assert (layout.prefill, layout.decode) == (PoolLayout(1, 2), PoolLayout(1))
    assert layout.serve_flags() == ["--prefill", "1", "--decode", "1", "--prefill-tp", "2"]
    assert layout.num_workers == 2 and layout.num_processes == 3
    piped = serve_layout(_plan(_unit((1, 1, 1), (1, 2, 1))))
    assert piped.serve_flags() == ["--prefill", "1", "--decode", "1", "--decode-pp", "2"]
    mixed = serve_layout(_plan(_unit((1, 1, 1), (1, 1, 1)), best_colocated=_unit(colocated=(2, 2, 1))),
                         "best_colocated")
    assert mixed.serve_flags() == ["--workers", "1", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    with pytest.raises(InvalidRequestError, match="tensor parallel \\(tp 2\\); here a worker runs tp <= 1"):
        serve_layout(_plan(_unit((2, 1, 1), (1, 1, 1))), max_tp=1)


def test_parallel_placement_sets_each_pools_degrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbaton.cli import _apply_placement, build_parser

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(_unit((2, 1, 1), (1, 2, 1)))))
    args = build_parser().parse_args(["serve", "--model", "tiny-random", "--placement", str(path)])
    monkeypatch.setattr(os, "cpu_count", lambda: 3)  # 1 prefill worker of 2 ranks + 1 decode worker of 2 stages
    with pytest.raises(InvalidRequestError, match="takes 2 workers of 4 rank processes"):
        _apply_placement(args)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    _apply_placement(args)
    assert (args.workers, args.prefill, args.decode) == (0, 1, 1)
    assert (args.prefill_tp, args.prefill_pp, args.decode_tp, args.decode_pp) == (2, 1, 1, 2)


def test_more_workers_than_the_machine_holds_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(_unit((1, 1, 3), (1, 1, 2)))))
    with pytest.raises(InvalidRequestError, match="takes 5 workers of 5 rank processes in all; this machine holds at "
                                                  "most 4"):
        read_serve_layout(str(path), max_workers=4)
    path.write_text(json.dumps(_plan(_unit((2, 1, 1), (1, 1, 1)))))
    with pytest.raises(InvalidRequestError, match="takes 2 workers of 3 rank processes"):
        read_serve_layout(str(path), max_workers=2)
    path.write_text("{not json")
    with pytest.raises(InvalidRequestError, match="is not JSON"):
        read_serve_layout(str(path))
    with pytest.raises(InvalidRequestError, match="cannot read"):
        read_serve_layout(str(tmp_path / "missing.json"))


def test_serve_command_says_how_to_launch_or_why_not() -> None:
    assert serve_command(_plan(_unit((1, 1, 1), (1, 1, 1)))).startswith(
        "kvbaton serve --model smollm2-135m --prefill 1 --decode 1")
    assert serve_command(_plan(_unit((2, 1, 1), (1, 1, 1)))).startswith(
        "kvbaton serve --model smollm2-135m --prefill 1 --decode 1 --prefill-tp 2")
    assert serve_command(_plan(_unit((1, 1, 0), (1, 1, 1)))).startswith("not launchable live: best: prefill.replicas")


def test_serve_refuses_a_plan_it_cannot_launch_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(_unit((1, 1, 1), (1, 1, 1), units=64))))
    assert main(["serve", "--placement", str(path)]) == 2
    err = capsys.readouterr().err
    assert "takes 128 workers" in err and err.count("\n") == 1
    path.write_text(json.dumps(_plan(_unit((2, 1, 1), (1, 1, 1)))))
    assert main(["serve", "--placement", str(path), "--prefill-tp", "2"]) == 2
    assert "--placement sets the workers' parallel degrees" in capsys.readouterr().err
    path.write_text(json.dumps(_plan(_unit((1, 1, 1), (1, 1, 1)))))
    assert main(["serve", "--placement", str(path), "--workers", "2"]) == 2
    assert "--placement sets the worker pools" in capsys.readouterr().err
