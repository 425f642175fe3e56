"""Regressions of the tokenizer layer."""

from __future__ import annotations

import pytest

from kvbaton.model.tokenizer import Tokenizer

CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("final", ["end", "im", "\n", "<|im_end|>"])
def test_continue_final_message_cuts_right_after_the_final_message(final: str) -> None:
    # Bug: apply_chat_template cuts at `rendered.rindex(final content)`, the LAST occurrence of the content in the
    # whole rendering. When the content also occurs in the template's text after the message (here
    # "<|im_end|>\n"), the prompt keeps part of the end-of-turn marker: content "end" gives "...assistant\nend<|im_end"
    # instead of "...assistant\nend". transformers (5.x) marks the message's end with a tag instead.
    tokenizer = Tokenizer.byte_level()
    role = "user" if final == "<|im_end|>" else "assistant"
    messages = [*CONVERSATION, {"role": role, "content": final}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    expected = closed[: closed.rindex(f"<|im_start|>{role}\n") + len(f"<|im_start|>{role}\n")] + final
    assert prompt == expected
