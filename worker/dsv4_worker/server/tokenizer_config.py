"""What a HuggingFace model directory says about its tokenizer beside `tokenizer.json`:
`tokenizer_config.json` (special tokens, `add_bos_token`, `added_tokens_decoder`, the chat
template), `chat_template.jinja` and `generation_config.json` (EOS ids). It reads and checks
those files and nothing more: no tokenizer, no jinja. Every problem is a `ValueError` that
names the file.

    file                       keys read (all optional)
    tokenizer_config.json      bos_token, eos_token, unk_token, pad_token, ... (a string,
                               {"content": ...} or null), add_bos_token, added_tokens_decoder,
                               chat_template (a string, or [{"name", "template"}] with "default")
    chat_template.jinja        the template; wins over tokenizer_config.json's (as in transformers)
    generation_config.json     eos_token_id (an id or a list of ids)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_FILE = "generation_config.json"
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
DEFAULT_TEMPLATE_NAME = "default"


class TemplateSource(NamedTuple):
    text: str
    origin: str  # where it came from, for error messages


@dataclass(frozen=True, slots=True)
class AddedTokenSpec:
    """One entry of `added_tokens_decoder`: the id `content` must have."""

    token_id: int
    content: str
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # only the keys that are set
    add_bos_token: bool | None = None  # None: the tokenizer.json post-processor decides
    added_tokens: tuple[AddedTokenSpec, ...] = ()
    chat_template: TemplateSource | None = None
    generation_eos_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id, in order

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")


def read_tokenizer_config(directory: Path) -> TokenizerConfig:
    """The three files in `directory`, each optional (none at all: an empty config)."""
    config_path = directory / CONFIG_FILE
    doc = _read_json_object(config_path) if config_path.is_file() else {}
    config = parse_tokenizer_config(doc, str(config_path))
    template_path = directory / TEMPLATE_FILE
    if template_path.is_file():
        try:
            text = template_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{template_path}: not UTF-8 text ({exc})") from exc
        config = replace(config, chat_template=TemplateSource(text, str(template_path)))
    generation_path = directory / GENERATION_FILE
    if generation_path.is_file():
        eos = _eos_ids(_read_json_object(generation_path).get("eos_token_id"), generation_path)
        config = replace(config, generation_eos_ids=eos)
    return config


def parse_tokenizer_config(doc: Mapping[str, object], origin: str) -> TokenizerConfig:
    """A parsed tokenizer_config.json -> TokenizerConfig; `origin` names it in errors."""
    special: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = _token_content(doc.get(key), f"{origin}: {key}")
        if token is not None:
            special[key] = token
    add_bos = doc.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise ValueError(f"{origin}: add_bos_token must be true or false, not {add_bos!r}")
    return TokenizerConfig(
        special_tokens=special,
        add_bos_token=add_bos,
        added_tokens=_added_tokens(doc.get("added_tokens_decoder"), origin),
        chat_template=_select_template(doc.get("chat_template"), origin),
    )


# ---- the pieces ------------------------------------------------------------------------------


def _read_json_object(path: Path) -> dict[str, object]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(doc).__name__}")
    return doc


def _token_content(value: object, where: str) -> str | None:
    """A special token given as a string, as {"content": ...} (older configs) or as null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f'{where} must be a string or {{"content": string}}, not {value!r}')


def _added_tokens(value: object, origin: str) -> tuple[AddedTokenSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(f"{origin}: added_tokens_decoder must be an object of id -> token")
    specs = []
    for key, entry in value.items():
        where = f"{origin}: added_tokens_decoder[{key!r}]"
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"{where}: the key must be a token id")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{where} must be an object with a string content")
        flags = {}
        for flag in ("special", "lstrip", "rstrip", "normalized", "single_word"):
            flag_value = entry.get(flag, False)
            if not isinstance(flag_value, bool):
                raise ValueError(f"{where}.{flag} must be true or false, not {flag_value!r}")
            flags[flag] = flag_value
        specs.append(AddedTokenSpec(int(key), entry["content"], **flags))
    return tuple(sorted(specs, key=lambda s: s.token_id))


def _select_template(value: object, origin: str) -> TemplateSource | None:
    """`chat_template` as a string, or as a list of {"name", "template"} (the "default" one)."""
    if value is None:
        return None
    if isinstance(value, str):
        return TemplateSource(value, f"{origin}: chat_template")
    if not isinstance(value, list):
        raise ValueError(f"{origin}: chat_template must be a string or a list, not {value!r}")
    named: dict[str, str] = {}
    for i, entry in enumerate(value):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("template"), str)
        ):
            raise ValueError(
                f"{origin}: chat_template[{i}] must be an object with string name and template"
            )
        named[entry["name"]] = entry["template"]
    if DEFAULT_TEMPLATE_NAME not in named:
        names = ", ".join(sorted(named)) or "none"
        raise ValueError(
            f"{origin}: chat_template lists templates ({names}) but none named "
            f"{DEFAULT_TEMPLATE_NAME!r}"
        )
    return TemplateSource(
        named[DEFAULT_TEMPLATE_NAME], f"{origin}: chat_template {DEFAULT_TEMPLATE_NAME!r}"
    )


def _eos_ids(value: object, path: Path) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [] if value is None else [value]
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them")
        ids.append(item)
    return tuple(dict.fromkeys(ids))
