"""A request body's bytes -> a request model, or an APIError saying what was wrong and what is allowed.

In order: the content type (JSON, or none given), UTF-8, JSON syntax, a JSON object, valid Unicode in
every string (a lone surrogate such as "\\ud800" parses as JSON but no tokenizer can take it), then the
schema.  Schema errors quote the field's description from `specdec.server.protocol`, e.g.
``stream must be true or false, got 'yes' (a string)``.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from specdec.server.protocol import APIError

SURROGATE = re.compile("[\ud800-\udfff]")
CONTAINERS = (str, list, dict)  # what can hold a string
Model = TypeVar("Model", bound=BaseModel)
JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
              float: "a number", type(None): "null"}


def parse_request(body: bytes, content_type: str | None, model: type[Model]) -> Model:
    check_content_type(content_type)
    data = parse_json_object(body, model)
    check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise schema_error(model, exc.errors(include_url=False)[0]) from None


def check_content_type(content_type: str | None) -> None:
    """JSON, or no Content-Type at all (read as JSON); anything else is a 415."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in ("", "application/json") or media.endswith("+json"):
        return
    raise APIError(415, f"the request body must be JSON with Content-Type: application/json, got Content-Type: "
                        f"{media}; send JSON with that header (curl: -H 'Content-Type: application/json')",
                   code="unsupported_media_type")


def parse_json_object(body: bytes, model: type[BaseModel]) -> dict[str, Any]:
    if not body.strip():
        raise APIError(400, f"the request body is empty: send a JSON object with {_required_fields(model)}",
                       param=_first_required(model))
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at offset "
                            f"{exc.start}): send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno}, "
                            f"column {exc.colno}") from None
    except ValueError as exc:  # NaN / Infinity, or an integer too long to convert
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body nests lists or objects too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object ({{...}}), got {_kind(data)}: send an object "
                            f"with {_required_fields(model)}")
    return data


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number: send a finite number")


def check_unicode(data: Any) -> None:
    """Every string (and key) must encode to UTF-8: JSON lets a lone UTF-16 surrogate through."""
    stack = [(data, "")]
    while stack:  # a loop, not recursion: JSON can nest deeper than Python's stack
        value, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, f"a field name in {path}" if path else "a field name")
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value) if isinstance(item, CONTAINERS))


def _check_string(text: str, path: str) -> None:
    found = SURROGATE.search(text)
    if found:
        raise APIError(400, f"{path or 'the request body'} is not valid Unicode: a lone surrogate "
                            f"U+{ord(found.group()):04X} at character {found.start()} (a \\u escape of a surrogate "
                            "must be half of a high-low pair); send valid UTF-8 text", param=_top(path))


def schema_error(model: type[BaseModel], error: dict[str, Any]) -> APIError:
    """One pydantic error as an APIError naming the field, what it allows and what it got."""
    loc = error.get("loc", ())
    path, allowed = _field_path(model, loc)
    param = str(loc[0]) if loc else None
    if error.get("type") == "missing":
        message = f"{path} is required" + (f": {allowed}" if allowed else "")
    elif allowed:
        message = f"{path} must be {allowed}, got {_shown(error.get('input'))}"
    else:
        message = f"{path or 'the request body'}: {error.get('msg', 'invalid value')}"
    return APIError(400, message, param=param)


def _field_path(model: type[BaseModel], loc: tuple) -> tuple[str, str | None]:
    """("messages", 0, "role") -> ("messages[0].role", the role field's description).

    Parts of loc that are not fields (a union member's tag such as "list[int]") end the walk."""
    path, allowed, current = "", None, model
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        field = current.model_fields.get(part) if current is not None else None
        if field is None:
            break
        path = f"{path}.{part}" if path else part
        allowed, current = field.description, _model_in(field.annotation)
    return path, allowed


def _model_in(annotation) -> type[BaseModel] | None:
    """The first pydantic model inside a type such as `list[ChatMessage] | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = "a value"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({_kind(value)})"


def _kind(value: Any) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def _required_fields(model: type[BaseModel]) -> str:
    names = [name for name, field in model.model_fields.items() if field.is_required()]
    return ", ".join(f"{name} ({model.model_fields[name].description})" for name in names) or "its fields"


def _first_required(model: type[BaseModel]) -> str | None:
    return next((name for name, field in model.model_fields.items() if field.is_required()), None)


def _top(path: str) -> str | None:
    return path.split(".", 1)[0].split("[", 1)[0] or None
