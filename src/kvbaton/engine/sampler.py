"""Turns the logits of sampling positions into tokens: structured-output masks, logit bias and penalties, greedy,
temperature, min-p, top-k, top-p, seeds, logprobs.

A structured-output request's grammar mask (`kvbaton.engine.structured`) comes first, as vLLM applies it to the
logits before its sampler: tokens the grammar forbids can be neither drawn nor reported. Adjustments come next,
in vLLM v1's order: below `min_tokens` outputs the end-of-sequence and stop tokens are
masked out, then the logit bias, then the repetition penalty over the prompt's and
the output's tokens (HF/CTRL: a positive logit divided by it, a negative one multiplied), then the frequency and
presence penalties over the output's tokens (OpenAI: minus frequency x count, minus presence once). Greedy
and sampled tokens are drawn from the adjusted logits; logprobs are of the raw model distribution (before
any adjustment, temperature, top-k or top-p, but after the grammar mask), as vLLM v1 reports them by default.

A row whose token cannot be drawn (a distribution torch refuses: none should reach it, tests/engine/
test_sampler_ranges.py searches every parameter range for one) fails its own request, never the step: the row
gets greedy's token, and `take_failed` gives the engine its request id and the reason to end that request with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from kvbaton.core.request import Request
from kvbaton.core.sampling import SamplingParams
from kvbaton.core.step import SampledToken


def adjust_logits(row: torch.Tensor, p: SamplingParams, prompt_token_ids: Sequence[int],
                  output_token_ids: Sequence[int], eos_token_id: int | None = None) -> None:
    """`row` (one request's logits) in place: `p`'s logit bias, then its penalties (see the module docstring);
    below `min_tokens` outputs, the end-of-sequence token (unless ignored) and the stop tokens cannot be drawn."""
    if len(output_token_ids) < p.min_tokens:
        banned = [*p.stop_token_ids, *([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])]
        banned = [t for t in banned if t < row.numel()]  # a stop token id past the vocabulary is never drawn anyway
        if banned:
            row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    for token_id, bias in p.logit_bias:
        row[token_id] += bias
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_token_ids).union(output_token_ids)), dtype=torch.long)
        if seen.numel():
            values = row[seen]
            # At least the dtype's smallest normal: a float32 product with a penalty that rounds to 0 would turn a
            # masked (-inf) logit into NaN, which no token can be drawn from.
            penalty = max(p.repetition_penalty, torch.finfo(row.dtype).tiny)
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_token_ids:
        ids, counts = torch.unique(torch.tensor(list(output_token_ids), dtype=torch.long), return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's output token at `position` (0 = its first): a hash of both, so every
    position has a stream of its own, whatever was drawn before it and wherever."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63: any torch generator takes it


class Sampler:
    """Draws the engine's tokens. A seeded request's token at output position i is drawn from a generator seeded by
    (seed, i) alone (`position_seed`): the same token wherever it is drawn (a handoff's prefill worker draws the
    first, a migrated request's new worker the ones after those it was given) and however (a plain decode, or a
    speculative chunk's verification, which draws each position's token and keeps the draft only when it is that
    token). An unseeded request draws from the engine's generator."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self._positions: dict[str, int] = {}  # a seeded request's next output position
        self._failed: dict[str, str] = {}  # requests whose token could not be drawn, with why, until taken

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self._positions.pop(request_id, None)

    def take_failed(self) -> dict[str, str]:
        """The requests whose token could not be drawn since the last call, with why (their rows got greedy's)."""
        failed, self._failed = self._failed, {}
        return failed

    def skip_draws(self, request_id: str, p: SamplingParams, num_tokens: int) -> None:
        """`num_tokens` tokens of this request were drawn elsewhere (a handoff's first token, on the prefill worker;
        a migrated request's output so far): a seeded request's next draw is at the position after them."""
        if p.seed is not None and not p.greedy:
            self._positions[request_id] = self._positions.get(request_id, 0) + num_tokens

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
        requests: Sequence[Request] | None = None, allowed: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampledToken]:
        """logits: [N, vocab] float32, row i for request_ids[i] (left as they are: masks and adjustments go to a copy);
        `requests[i]` is that request (its prompt and output so far, for the penalties), needed when any of
        `params` adjusts its logits; `allowed[i]`, when not None, is row i's [vocab] bool grammar mask."""
        if logits.device.type != "cpu":
            # An accelerator's logits: a plain greedy batch takes its argmax there (only the ids cross to the host);
            # anything else is sampled on the host, where the grammar masks and the seeded generators live, so a
            # seed draws the same tokens on every device.
            if allowed is None and all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params):
                return [SampledToken(token) for token in torch.argmax(logits, dim=-1).tolist()]
            logits = logits.float().cpu()
        owned = allowed is not None  # logits are the model's (inference tensors): adjust a copy
        if allowed is not None:
            logits = logits.clone()
            for i, mask in enumerate(allowed):
                if mask is not None:
                    logits[i].masked_fill_(~mask, float("-inf"))
        need_logprobs = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None  # of the raw logits
        if any(p.adjusts_logits for p in params):
            if requests is None:
                raise ValueError("penalties and logit_bias need each row's request")
            if not owned:
                logits = logits.clone()
            for i, p in enumerate(params):
                if p.adjusts_logits:
                    request = requests[i]
                    adjust_logits(logits[i], p, request.prompt_token_ids, request.output_token_ids,
                                  request.eos_token_id)
        greedy_ids = torch.argmax(logits, dim=-1)
        tokens: list[int] = greedy_ids.tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                try:
                    tokens[i] = self._sample_row(logits[i], p, request_ids[i])
                except RuntimeError as exc:
                    self._failed[request_ids[i]] = f"its next token could not be drawn ({exc})"
        return [_sampled(tokens[i], None if logprobs is None else logprobs[i], p) for i, p in enumerate(params)]

    def verify(self, rows: torch.Tensor, drafts: Sequence[int], p: SamplingParams,
               request_id: str) -> list[SampledToken]:
        """A speculative chunk's verdict. rows: [1 + k, vocab] float32 logits, row i the distribution that follows
        the request's tokens and `drafts[:i]`. Returns the drafts the model agrees with, in order, then one token
        of its own: greedy, the drafts while they equal its argmax and then its argmax, so the tokens are
        exactly those plain decodes would give; sampled, each draft x kept with probability p(x) (p after
        temperature, min-p, top-k and top-p) and else replaced by a draw from p without x, renormalised, which
        leaves every token distributed as p (speculative sampling with a draft that is certain of its token)."""
        rows = rows.float().cpu()  # a no-op on the CPU; an accelerator's rows are judged on the host (see `sample`)
        logprobs = torch.log_softmax(rows, dim=-1) if p.logprobs is not None else None
        tokens: list[int] = []
        if p.greedy:
            best = torch.argmax(rows, dim=-1).tolist()
            for i, draft in enumerate(drafts):
                if best[i] != draft:
                    break
                tokens.append(draft)
            tokens.append(best[len(tokens)])
        else:
            # Each position's token is drawn from p as a plain decode would draw it (the same draw: see the class);
            # a draft is kept when it is that token, with probability p(draft), and the chunk ends at the first
            # that is not. Every token is distributed as p, and a seeded request's tokens do not depend on drafts.
            for i in range(len(drafts) + 1):
                try:
                    tokens.append(int(torch.multinomial(self._probs(rows[i], p), 1,
                                                        generator=self._generator_for(request_id, p)).item()))
                except RuntimeError as exc:
                    self._failed[request_id] = f"its next token could not be drawn ({exc})"
                    tokens.append(int(torch.argmax(rows[i])))
                    break
                if i == len(drafts) or tokens[-1] != drafts[i]:
                    break
        return [_sampled(t, None if logprobs is None else logprobs[i], p) for i, t in enumerate(tokens)]

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, request_id: str) -> int:
        if p.grammar and bool(torch.isneginf(row).all()):
            # Nothing is left to draw (a grammar mask and min_tokens' bans together): greedy's token 0, which
            # the grammar then refuses, so the request fails with a reason instead of the step raising.
            return 0
        return int(torch.multinomial(self._probs(row, p), 1, generator=self._generator_for(request_id, p)).item())

    def _probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a sampled token is drawn from: tempered, then min-p, top-k and top-p."""
        # At most float32's max: a logit a repetition penalty near 0 divided into inf would make softmax NaN.
        scaled = (row / p.temperature).clamp(max=torch.finfo(row.dtype).max)
        if p.min_p > 0.0:  # as vLLM v1: on the tempered distribution, before top-k and top-p
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
            drop = cumulative - sorted_probs >= p.top_p
            drop[0] = False  # the most likely stays: a top_p below float32's least value is 0 here
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            # renormalised: `verify` accepts a draft with its probability, which must be its share of the nucleus
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs / sorted_probs.sum())
        return probs

    def _generator_for(self, request_id: str, p: SamplingParams) -> torch.Generator:
        """The generator of the request's next draw: a seeded one's is seeded for its next output position (which
        this draw takes)."""
        if p.seed is None:
            return self._generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = self._request_generators[request_id] = torch.Generator()
        position = self._positions.get(request_id, 0)
        self._positions[request_id] = position + 1
        return gen.manual_seed(position_seed(p.seed, position))


def _sampled(token_id: int, row_logprobs: torch.Tensor | None, p: SamplingParams) -> SampledToken:
    """`token_id` with its logprob and the top ones from `row_logprobs` when the request asked for logprobs."""
    if row_logprobs is None or p.logprobs is None:
        return SampledToken(token_id)
    top: tuple[tuple[int, float], ...] = ()
    if p.logprobs > 0:
        values, ids = torch.topk(row_logprobs, p.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return SampledToken(token_id, float(row_logprobs[token_id]), top)
