"""Chat messages → prompt token ids: the one place the platform applies a chat template.

Generation, regeneration, evaluation, training data and the benchmark scripts all render through
`render_chat`, so a prompt is tokenized identically wherever it is built.
"""

from __future__ import annotations

from collections.abc import Sequence


def render_chat(tokenizer, messages: Sequence[dict], *, generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` ([{"role", "content"}, ...]) through the tokenizer's chat template;
    `generation_prompt` appends the assistant header (the prompt for the next answer)."""
    enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True)
    # transformers returns a BatchEncoding (a mapping) or a plain list, depending on the version.
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def user_prompt(tokenizer, message: str) -> list[int]:
    """Ids of one user message with the generation prompt (`drelay generate --chat`)."""
    return render_chat(tokenizer, [{"role": "user", "content": message}])
