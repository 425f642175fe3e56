"""Sampling parameters of one request (a frozen value, validated once at ingress)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbaton.core.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_GRAMMAR_CHARS = 1 << 20  # a structured-output grammar's serialized size at most
MAX_STOP_TOKEN_IDS = 1024  # each is checked against every output token
MAX_PRIORITY = (1 << 31) - 1  # |priority| at most (a 32-bit int, so it stays one msgpack int everywhere)
# A temperature below this samples greedily, as vLLM's: dividing float32 logits by a smaller one can overflow.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # number of output tokens to generate at most
    temperature: float = 1.0  # 0 (or below MIN_SAMPLING_TEMPERATURE) means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the most likely one; 0 disables
    seed: int | None = None  # per-request RNG seed; None draws from the engine's RNG
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not returned (unless include_stop_str_in_output)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the request (returned)
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    include_stop_str_in_output: bool = False  # vLLM's: the output keeps the stop string that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens (e.g. <|im_end|>) are left out of the text
    logprobs: int | None = None  # also return the top-N logprobs per sampled token (0 = only the sampled one)
    # Also return each prompt token's logprob given the tokens before it, with the top-N (0 = only its own), as
    # vLLM's prompt_logprobs; such a request computes its whole prompt (it reads nothing from the prefix cache).
    prompt_logprobs: int | None = None
    n: int = 1  # samples per prompt (each becomes its own engine request)
    min_tokens: int = 0  # vLLM's: no end-of-sequence, stop token or stop string ends the output before this many
    # Logit adjustments before sampling (as vLLM applies them; logprobs stay those of the raw model):
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/CTRL's: a token of the prompt or output has its logit divided by it (> 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's logit_bias
    # Structured output: an llguidance grammar (`kvbaton.engine.structured.grammar_for` builds one from a JSON
    # schema, regex, choice list or Lark grammar) that masks every step's logits; "" for none.
    grammar: str = ""
    # vLLM's request priority: under the "priority" queue policy (kvbaton serve --scheduling-policy priority) a
    # lower value is admitted first and preempted last; other policies ignore it. Not a sampling parameter, but it
    # travels with them to every worker that schedules the request.
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias:
            object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in self.logit_bias))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens changes this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def for_sample(self, index: int) -> SamplingParams:
        """Sample `index` of this request's n, as its own engine request: n = 1 and, when seeded, seed + index (as
        vLLM seeds parallel samples, so they differ); a seed past 2**64 - 1 wraps, as seeds travel as 64-bit ints."""
        if self.seed is None or index == 0:
            return self if self.n == 1 else replace(self, n=1)
        seed = self.seed + index
        return replace(self, n=1, seed=seed - 2**64 if seed >= 2**64 else seed)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 16:
            raise InvalidRequestError(f"n must be an integer in [1, 16], got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not isinstance(t, int) or t < 0
                                                                for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
        if self.min_tokens != 0 and (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                                     or not 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.priority != 0 and (isinstance(self.priority, bool) or not isinstance(self.priority, int)
                                   or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY):
            raise InvalidRequestError(f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}], "
                                      f"got {self.priority!r}")
        if self.grammar and (not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS):
            raise InvalidRequestError(f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        # The logit adjustments and min_p, checked only when one is set (most requests set none; the router
        # validates every request at ingress).
        if (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.logit_bias or self.min_p != 0.0):
            self._validate_adjustments()

    def _validate_adjustments(self) -> None:
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not 0.0 < penalty <= 10.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got {token_id!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r}")
