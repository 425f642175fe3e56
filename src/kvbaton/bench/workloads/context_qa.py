"""`video-qa` and `long-doc-qa`: one long shared context (video tokens, a document), several short questions.

Shapes from Preble (ICLR 2025, arXiv 2407.00023) Table 1, as we read the paper:

- video QA (NExT-QA): prompt 9,865 ± 5,976 tokens, output 4 ± 1.5, sharing 88 %, a prefix
  reused by 8.6 requests on average. We use 9,800 ± 5,900-token videos (clipped to 256..65,536)
  with 1 + Poisson(7.6) questions each (mean 8.6) of 40 ± 15 tokens.
- long-document QA (LooGLE): prompt 23,474 ± 6,105, output 16 ± 9.9, sharing 91 %. We use
  23,400 ± 6,100-token documents with 1 + Poisson(11) questions each (mean 12) of 60 ± 25
  tokens: with sharing measured against *earlier* requests, a context's first question is a
  miss, so the mean count per context sets the measured sharing near 1 - 1/count.

Every prompt is a 64-token instruction shared by all, the context, then the question. Eight
contexts are open at a time and their questions interleave (`interleave_sessions`). Use
`length_scale` (e.g. 0.25) to fit a small-context model; output lengths are not scaled.
"""

from __future__ import annotations

import random

import numpy as np

from kvbaton.bench.tokens import random_tokens
from kvbaton.bench.workloads.base import (
    Draft, check_positive, interleave_sessions, lognormal_lengths, scaled, split_rng,
)


def _context_qa(*, total: int, vocab_size: int, rng: np.random.Generator, instruction_tokens: int,
                context_mean_tokens: float, context_std_tokens: float, min_context_tokens: int,
                max_context_tokens: int, mean_questions: float, question_mean_tokens: float,
                question_std_tokens: float, output_mean_tokens: float, output_std_tokens: float,
                num_active: int, length_scale: float, group_label: str) -> list[Draft]:
    check_positive(total=total, mean_questions=mean_questions, length_scale=length_scale)
    rng, token_rng = split_rng(rng)
    instruction = random_tokens(token_rng, scaled(instruction_tokens, length_scale), vocab_size)
    sessions: list[list[Draft]] = []
    num_drafted = 0
    while num_drafted < total:
        context_len = lognormal_lengths(rng, 1, context_mean_tokens, context_std_tokens, low=min_context_tokens,
                                        high=max_context_tokens)[0]
        context = random_tokens(token_rng, scaled(context_len, length_scale), vocab_size)
        num_questions = 1 + int(rng.poisson(mean_questions - 1)) if mean_questions > 1 else 1
        question_lengths = lognormal_lengths(rng, num_questions, question_mean_tokens, question_std_tokens, low=4)
        output_lengths = lognormal_lengths(rng, num_questions, output_mean_tokens, output_std_tokens, low=1,
                                           high=256)
        group = f"{group_label}{len(sessions)}"
        sessions.append([
            Draft(prompt_parts=(instruction, context, random_tokens(token_rng, scaled(q, length_scale), vocab_size)),
                  output_tokens=o, group=group)
            for q, o in zip(question_lengths, output_lengths)])
        num_drafted += num_questions
    return interleave_sessions(rng, sessions, num_active, total)


def generate_video_qa(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                      arrival_rng: random.Random, rate: float | None, instruction_tokens: int = 64,
                      video_mean_tokens: float = 9800, video_std_tokens: float = 5900,
                      questions_per_video: float = 8.6, question_mean_tokens: float = 40,
                      question_std_tokens: float = 15, output_mean_tokens: float = 4, output_std_tokens: float = 1.5,
                      num_active_videos: int = 8, length_scale: float = 1.0) -> list[Draft]:
    return _context_qa(total=num_requests or 1000, vocab_size=vocab_size, rng=rng,
                       instruction_tokens=instruction_tokens, context_mean_tokens=video_mean_tokens,
                       context_std_tokens=video_std_tokens, min_context_tokens=256, max_context_tokens=65_536,
                       mean_questions=questions_per_video, question_mean_tokens=question_mean_tokens,
                       question_std_tokens=question_std_tokens, output_mean_tokens=output_mean_tokens,
                       output_std_tokens=output_std_tokens, num_active=num_active_videos,
                       length_scale=length_scale, group_label="video")


def generate_long_doc_qa(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                         arrival_rng: random.Random, rate: float | None, instruction_tokens: int = 64,
                         doc_mean_tokens: float = 23_400, doc_std_tokens: float = 6100,
                         questions_per_doc: float = 12, question_mean_tokens: float = 60,
                         question_std_tokens: float = 25, output_mean_tokens: float = 16,
                         output_std_tokens: float = 9.9, num_active_docs: int = 8,
                         length_scale: float = 1.0) -> list[Draft]:
    return _context_qa(total=num_requests or 1000, vocab_size=vocab_size, rng=rng,
                       instruction_tokens=instruction_tokens, context_mean_tokens=doc_mean_tokens,
                       context_std_tokens=doc_std_tokens, min_context_tokens=1024, max_context_tokens=131_072,
                       mean_questions=questions_per_doc, question_mean_tokens=question_mean_tokens,
                       question_std_tokens=question_std_tokens, output_mean_tokens=output_mean_tokens,
                       output_std_tokens=output_std_tokens, num_active=num_active_docs,
                       length_scale=length_scale, group_label="doc")
