"""What tensor parallelism costs on this machine: TP 1 against TP N and PP 2 (one thread per rank), and a handoff from
a TP N prefill worker to a TP 1 decode worker against TP 1 -> TP 1, in one run; one JSON line.

N is `--tp`, by default 2 where the model's KV heads divide by 2, else their count (kvbaton splits KV heads and
does not replicate them: SmolLM2-135M has 3, so its default is TP 3 on this 2-core machine).

Engine part (`LLM`, in this process and its rank processes; the engines measured in turn, repeat by repeat, best
of `--repeats`): prefill tok/s of one `--prompt-tokens` prompt (no prefix cache), and decode tok/s of `--batch`
requests decoding `--decode-tokens` each (output tokens after the first over the time from the first first token
to the last finish).
Handoff part (`kvbaton serve --prefill 1 --decode 1 --prefill-tp A` for A = 1 and N, both started here, their
requests taken in turn, stopped by process group): the mean
transfer time per handoff (the prefill worker's first chunk sent -> ack, as its /cluster counters sum it) of
`--repeats` distinct `--prompt-tokens` prompts, each prefilled in one step (the token budget covers it), so the
time is the streaming of every layer and the ack, not the prefill. On 2 shared cores TP may well be slower: the
ratios are reported as they are.

    .venv/bin/python benchmarks/parallel.py [--model smollm2-135m] [--tp N] [--prompt-tokens 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence

import torch

from kvbaton import LLM, SamplingParams
from kvbaton.model.registry import read_model_header, resolve_model_source


def _prompt(num_tokens: int, offset: int, vocab_size: int) -> list[int]:
    return [(i * 7919 + offset * 104729) % (vocab_size - 300) + 200 for i in range(num_tokens)]


def engine_rates(model: str, dtype: str, degrees: dict[str, tuple[int, int]],
                 args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Prefill and decode tok/s of each (tp, pp) in `degrees`, every engine built first and measured in turn, repeat
    by repeat (best of the repeats), so the host's load swings reach each one alike."""
    torch.set_num_threads(1)
    llms = {name: LLM(model, dtype=dtype, num_blocks=1024, enable_prefix_cache=False, max_num_batched_tokens=2048,
                      tensor_parallel_size=tp, pipeline_parallel_size=pp, rank_num_threads=1)
            for name, (tp, pp) in degrees.items()}
    try:
        vocab = next(iter(llms.values())).engine.loaded.config.vocab_size
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        rates: dict[str, dict[str, float]] = {name: {"prefill_tok_s": 0.0, "decode_tok_s": 0.0} for name in llms}
        for r in range(args.repeats):
            for name, llm in llms.items():
                prefill_s = llm.generate(_prompt(args.prompt_tokens, r, vocab), one)[0].ttft_s
                rates[name]["prefill_tok_s"] = max(rates[name]["prefill_tok_s"], args.prompt_tokens / prefill_s)
                outs = [res.outputs[0] for res in
                        llm.generate([_prompt(32, 100 + i, vocab) for i in range(args.batch)], params)]
                decode_s = max(o.finished_at for o in outs) - min(o.first_token_at for o in outs)
                decoded = sum(len(o.token_ids) - 1 for o in outs) / decode_s
                rates[name]["decode_tok_s"] = max(rates[name]["decode_tok_s"], decoded)
        return rates
    finally:
        for llm in llms.values():
            llm.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _transfer_time_after(url: str, num_completed: int) -> float:
    """The prefill worker's summed transfer time once its heartbeat counts `num_completed` handoffs."""
    deadline = time.monotonic() + 60
    while True:
        transfers = next(w for w in _get(f"{url}/cluster")["workers"] if w["role"] == "prefill")["transfers"]
        if transfers["num_completed"] == num_completed:
            return float(transfers["time_s"])
        if transfers["num_completed"] > num_completed or time.monotonic() > deadline:
            raise RuntimeError(f"{transfers['num_completed']} handoffs completed, expected {num_completed}")
        time.sleep(0.2)


@contextlib.contextmanager
def pd_server(model: str, dtype: str, prefill_tp: int, args: argparse.Namespace) -> Iterator[str]:
    """`kvbaton serve --prefill 1 --decode 1 --prefill-tp N` until the block ends (then SIGINT, SIGKILL by group)."""
    port = _free_port()
    command = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", model, "--dtype", dtype, "--prefill", "1",
               "--decode", "1", "--prefill-tp", str(prefill_tp), "--local-prefill-threshold", "0",
               "--max-num-batched-tokens", str(args.prompt_tokens + 48), "--threads-per-worker", "1",
               "--num-blocks", "512", "--kv-store-gb", "0", "--port", str(port)]  # no store: TP is the subject
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if _get(f"{url}/health") is not None and len(_get(f"{url}/cluster")["workers"]) == 2:
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {' '.join(command)}")
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def handoff_times(model: str, dtype: str, degrees: dict[str, int], args: argparse.Namespace,
                  vocab: int) -> dict[str, float]:
    """Mean transfer time per handoff of a server per prefill degree, all running, their requests taken in turn."""
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(pd_server(model, dtype, tp, args)) for name, tp in degrees.items()}
        time_s: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.repeats + 1):  # the first warms the link and the shapes up; its time is left out
            for name, url in urls.items():
                _post(f"{url}/v1/completions", {"model": model, "prompt": _prompt(args.prompt_tokens, 500 + r, vocab),
                                                "max_tokens": 2, "temperature": 0.0})
                time_s[name].append(_transfer_time_after(url, r + 1))
        return {name: (times[-1] - times[0]) / args.repeats for name, times in time_s.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="float32 by default: this host has no fast bfloat16 matmul")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, default=0, help="the degree set beside TP 1 (0: see above)")
    args = parser.parse_args(argv)
    config, _ = read_model_header(resolve_model_source(args.model))
    vocab = config.vocab_size
    tp = args.tp or (2 if config.num_kv_heads % 2 == 0 else config.num_kv_heads)
    rates = engine_rates(args.model, args.dtype, {"tp1": (1, 1), "tpN": (tp, 1), "pp2": (1, 2)}, args)
    tp1, tpn, pp2 = rates["tp1"], rates["tpN"], rates["pp2"]
    handoffs = handoff_times(args.model, args.dtype, {"tp1": 1, "tpN": tp}, args, vocab)
    handoff_tp1, handoff_tpn = handoffs["tp1"], handoffs["tpN"]
    print(json.dumps({
        "model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "batch": args.batch,
        "cpu_count": os.cpu_count(), "threads_per_rank": 1, "tp": tp,
        "tp1_prefill_tok_s": round(tp1["prefill_tok_s"], 1), "tpN_prefill_tok_s": round(tpn["prefill_tok_s"], 1),
        "tp1_decode_tok_s": round(tp1["decode_tok_s"], 1), "tpN_decode_tok_s": round(tpn["decode_tok_s"], 1),
        "tpN_over_tp1_prefill": round(tpn["prefill_tok_s"] / tp1["prefill_tok_s"], 3),
        "tpN_over_tp1_decode": round(tpn["decode_tok_s"] / tp1["decode_tok_s"], 3),
        "pp2_prefill_tok_s": round(pp2["prefill_tok_s"], 1), "pp2_decode_tok_s": round(pp2["decode_tok_s"], 1),
        "pp2_over_tp1_prefill": round(pp2["prefill_tok_s"] / tp1["prefill_tok_s"], 3),
        "pp2_over_tp1_decode": round(pp2["decode_tok_s"] / tp1["decode_tok_s"], 3),
        "handoff_tp1_to_tp1_s": round(handoff_tp1, 4), "handoff_tpN_to_tp1_s": round(handoff_tpn, 4),
        "handoff_tpN_over_tp1": round(handoff_tpn / handoff_tp1, 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
