"""A tiny DeepSeek-style HuggingFace model directory for tokenizer tests: a byte-level BPE
trained here on a few sentences (DeepSeek's special tokens, a post-processor that adds BOS, as
DeepSeek's tokenizer.json does) and a tokenizer_config.json with a chat template of our own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
EOT = "<|EOT|>"
SPECIALS = (BOS, EOS, USER, ASSISTANT, EOT)  # the trainer gives them ids 0..4 in this order
BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID, EOT_ID = range(5)
TRAINED_VOCAB = 400
MODEL_VOCAB = 512

SENTENCES = [
    "Hello! How are you today?",
    "I am fine, thank you. And you?",
    "Be brief and answer in one sentence.",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストも少し。",
    "What is two plus two? Two plus two is four.",
]

# DeepSeek-style: BOS, the system prompt, then alternating user / assistant turns; every
# assistant turn ends with EOS; add_generation_prompt opens the assistant's turn.
DEEPSEEK_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "  {%- set system = messages[0]['content'] -%}\n"
    "  {%- set turns = messages[1:] -%}\n"
    "{%- else -%}\n"
    "  {%- set system = '' -%}\n"
    "  {%- set turns = messages -%}\n"
    "{%- endif -%}\n"
    "{{ bos_token }}{{ system }}\n"
    "{%- for message in turns -%}\n"
    "  {%- if message['role'] == 'system' -%}\n"
    "    {{ raise_exception('a system message may only come first') }}\n"
    "  {%- endif -%}\n"
    "  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "    {{ raise_exception('turns must alternate user, assistant, user, ...') }}\n"
    "  {%- endif -%}\n"
    "  {%- if message['role'] == 'user' -%}\n"
    "    <｜User｜>{{ message['content'] }}\n"
    "  {%- else -%}\n"
    "    <｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  <｜Assistant｜>\n"
    "{%- endif -%}\n"
)


def build_bpe() -> Any:
    """The trained `tokenizers.Tokenizer` (skips the test without the package)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB,
        special_tokens=list(SPECIALS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.post_processor = tokenizers.processors.Sequence(
        [
            tokenizers.processors.ByteLevel(trim_offsets=False),
            tokenizers.processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    assert [tok.token_to_id(t) for t in SPECIALS] == list(range(len(SPECIALS)))
    return tok


def write_model_dir(
    directory: Path,
    *,
    config: dict[str, Any] | None = None,
    generation: dict[str, Any] | None = None,
) -> Any:
    """tokenizer.json, and tokenizer_config.json (`config`, None: no file) and
    generation_config.json (`generation`, None: no file) in `directory`; returns the
    `tokenizers.Tokenizer` written."""
    tok = build_bpe()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return tok


def deepseek_config(**extra: Any) -> dict[str, Any]:
    """A tokenizer_config.json as DeepSeek writes one (BOS as an object, EOS as a string)."""
    return {
        "add_bos_token": True,
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS,
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
        },
        "eos_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEEPSEEK_TEMPLATE,
        **extra,
    }


def conv(messages: list[dict[str, Any]], **kw: Any) -> Any:
    """A `Conversation` of OpenAI-shaped messages (as a request's `messages`)."""
    from dsv4_worker.server.chat_messages import parse_messages
    from dsv4_worker.server.conversation import Conversation

    return Conversation(parse_messages({"messages": messages}), **kw)
