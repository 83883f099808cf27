"""Text <-> token ids from a model directory's tokenizer.json, EOS ids and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the model's special tokens and chat template."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json; pass token ids instead of text, "
                                 "or add the tokenizer to the directory")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        self.config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = _chat_template(model_dir, self.config)
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a chat (list of {"role", "content"}) to the prompt text the model was trained on."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a plain completion prompt")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json's."""
    raw = _read_json(Path(model_dir) / "generation_config.json").get("eos_token_id")
    ids = [raw] if isinstance(raw, int) else list(raw or [])
    for i in config_eos:
        if i not in ids:
            ids.append(i)
    return tuple(int(i) for i in ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_template_error(message: str):
    raise InvalidRequestError(f"chat template rejected the messages: {message}")
