"""`--device` names: cpu / cuda / cuda:N resolved in one place, a bad or absent device refused in one line."""

from __future__ import annotations

import pytest
import torch

from kvbaton.cli import _serve_device, build_parser, main
from kvbaton.core.errors import InvalidRequestError
from kvbaton.llm import LLM
from kvbaton.model.device import check_device_name, resolve_device
from kvbaton.server.launcher import ServeConfig, worker_args

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_names_are_checked_without_touching_cuda() -> None:
    assert [check_device_name(n) for n in ("cpu", "cuda", "cuda:3")] == ["cpu", "cuda", "cuda:3"]
    for bad in ("gpu", "cuda:", "cuda:-1", "CUDA", "cpu:0", ""):
        with pytest.raises(InvalidRequestError, match="unknown device .*choose cpu, cuda, cuda:N"):
            check_device_name(bad)
    assert resolve_device("cpu") == torch.device("cpu")


@no_cuda
def test_cuda_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(InvalidRequestError, match="'cuda:1' requested but CUDA is not available on this machine"):
        resolve_device("cuda:1")
    with pytest.raises(InvalidRequestError, match="CUDA is not available"):
        LLM("tiny-random", dtype="float32", num_blocks=16, device="cuda")


def test_llm_runs_on_the_named_device() -> None:
    llm = LLM("tiny-random", dtype="float32", num_blocks=16, device="cpu")
    assert llm.engine.storage.kv_cache.device == torch.device("cpu")
    assert llm.engine.loaded.model.embed_tokens.device == torch.device("cpu")
    assert len(llm.generate([1, 2, 3])[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "tiny-random", "--prompt", "hi", "--device", "tpu"], "unknown device 'tpu'"),
    (["serve", "--model", "tiny-random", "--device", "gpu0"], "unknown device 'gpu0'"),
    (["worker", "--router", "tcp://127.0.0.1:1", "--model", "tiny-random", "--device", "cuda:x"],
     "unknown device 'cuda:x'"),
    (["serve", "--model", "tiny-random", "--ray", "local", "--gpus-per-worker", "1", "--device", "cpu"],
     "--gpus-per-worker reserves GPUs for each worker, which --device cpu would leave unused"),
    (["serve", "--model", "tiny-random", "--ray", "local", "--gpus-per-worker", "1", "--device", "cuda:1"],
     "Ray narrows each worker's CUDA_VISIBLE_DEVICES to its 1 GPU"),
])
def test_bad_device_flags_are_one_line_errors(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@no_cuda
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_cuda_flag_without_cuda_fails_before_anything_starts(command: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", "tiny-random", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' requested but CUDA is not available" in err and err.count("\n") == 1


def test_serve_hands_its_device_to_every_worker() -> None:
    args = worker_args(ServeConfig(model="tiny-random", device="cuda:0"), "tcp://127.0.0.1:1", "w0")
    assert args[args.index("--device") + 1] == "cuda:0"
    default = worker_args(ServeConfig(model="tiny-random"), "tcp://127.0.0.1:1", "w0")
    assert default[default.index("--device") + 1] == "cpu"


def test_gpus_per_worker_puts_each_ray_worker_on_its_own_gpus() -> None:
    parser = build_parser()
    assert _serve_device(parser.parse_args(["serve", "--ray", "local", "--gpus-per-worker", "1"])) == "cuda"
    assert _serve_device(parser.parse_args(["serve", "--ray", "local", "--gpus-per-worker", "2",
                                            "--device", "cuda:1"])) == "cuda:1"
    assert _serve_device(parser.parse_args(["serve", "--ray", "local", "--gpus-per-worker", "0.5",
                                            "--device", "cuda:0"])) == "cuda:0"  # a shared GPU is still device 0
    assert _serve_device(parser.parse_args(["serve"])) == "cpu"
