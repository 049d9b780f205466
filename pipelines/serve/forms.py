"""POST /v1/videos bodies into one `api.VideoCreate`, whichever way they come: JSON, or
`multipart/form-data` as OpenAI's Videos API defines it and its official SDK always sends it
(`client.videos.create(...)`, with or without an `input_reference` file part), or a urlencoded form.

A form has no types: each field is read as the type `VideoCreate` publishes for it (an integer
field "17" is 17, a number field "4.5" is 4.5; text that is not such a number stays text and gets
the same message as a JSON string would). `lora` may repeat (`lora`, or the SDK's `lora[]`). An
`input_reference` is a file part, or `input_reference[image_url]` (a base64 data URL), as the SDK
encodes its reference object.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

from pipelines.serve import api

_INTEGER = re.compile(r"[+-]?\d{1,30}")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)
MAX_FORM_FIELDS = 64


@dataclasses.dataclass(frozen=True)
class Upload:
  """An `input_reference` as sent: its bytes, and the file part's name and content type (None for a
  data URL's name)."""
  data: bytes
  filename: str | None
  content_type: str | None


async def read_create(request: Any, config: Any) -> tuple[api.VideoCreate, Upload | None]:
  """POST /v1/videos's body as a `VideoCreate` and its upload: a form when the content type says so,
  else JSON. JSON may hold `config.max_body_bytes`; a form that much more than an upload,
  `config.max_upload_bytes`.

  Raises:
    api.ApiError: 413 past the limit (before more is read); 400 as `parse_form` / `parse_json`.
  """
  kind = request.headers.get("content-type", "").lower()
  form = kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))
  limit = config.max_body_bytes + (config.max_upload_bytes if form else 0)
  raw = await read_body(request, limit)
  return await parse_form(raw, request.headers) if form else (parse_json(raw), None)


async def read_body(request: Any, limit: int) -> bytes:
  """The request body, refused (413) past `limit` bytes before more is read."""
  declared = request.headers.get("content-length")
  too_large = api.ApiError(413, f"the request body is over this server's limit of {limit} bytes", code="too_large")
  if declared is not None and (not declared.isdigit() or int(declared) > limit):
    raise too_large
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > limit:
      raise too_large
  return bytes(body)


def validation_error(errors: list[dict[str, Any]]) -> api.ApiError:
  """pydantic's first error as a 400 naming the field."""
  first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
  field = ".".join(str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")) or None
  what = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
  return api.ApiError(400, f"{field or 'body'}: {what}", field)


def parse_json(raw: bytes, model: type = api.VideoCreate) -> Any:
  """A JSON body as `model` (a `VideoCreate` by default).

  Raises:
    api.ApiError: not a JSON object, or a field of the wrong kind or unknown (naming it).
  """
  try:
    data = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise api.ApiError(400, f"the body is not JSON ({e}); send a JSON object like {{\"prompt\": \"...\"}}, or "
                       "multipart/form-data") from e
  if not isinstance(data, dict):
    raise api.ApiError(400, f"the body must be a JSON object, not a {type(data).__name__}")
  return validated(data, model)


def validated(data: dict[str, Any], model: type = api.VideoCreate) -> Any:
  try:
    return model.model_validate(data)
  except ValidationError as e:
    raise validation_error(e.errors()) from e


async def parse_form(raw: bytes, headers: Headers) -> tuple[api.VideoCreate, Upload | None]:
  """A multipart or urlencoded body as a `VideoCreate` and its `input_reference` upload (or None).

  Raises:
    api.ApiError: a malformed form, more than one file or `MAX_FORM_FIELDS` fields, a field of the
      wrong kind or unknown (naming it).
  """
  async def stream():
    yield raw
    yield b""

  kind = headers.get("content-type", "")
  try:
    if kind.startswith("multipart/form-data"):
      form = await MultiPartParser(headers, stream(), max_files=1, max_fields=MAX_FORM_FIELDS,
                                   max_part_size=len(raw) + 1).parse()
    else:
      form = await FormParser(headers, stream()).parse()
  except (MultiPartException, ValueError) as e:
    raise api.ApiError(400, f"the multipart/form-data body cannot be read: {e}") from e
  try:
    data, upload = await _form_fields(form)
  finally:
    await form.close()
  return validated(data), upload


async def _form_fields(form: FormData) -> tuple[dict[str, Any], Upload | None]:
  data: dict[str, Any] = {}
  upload = None
  reference: dict[str, str] = {}
  for name, value in form.multi_items():
    if isinstance(value, UploadFile):
      if name != "input_reference":
        raise api.ApiError(400, f"{name}: a file part; only input_reference takes a file", name)
      upload = Upload(await value.read(), value.filename, value.content_type)
    elif name in ("lora", "lora[]"):
      data.setdefault("lora", []).append(value)
    elif (match := re.fullmatch(r"input_reference\[(\w+)\]", name)) is not None:
      reference[match.group(1)] = value
    elif name in data:
      raise api.ApiError(400, f"{name}: given more than once", name)
    else:
      data[name] = _typed_value(name, value)
  if reference:
    data["input_reference"] = reference
  return data, upload


def _typed_value(name: str, text: str) -> Any:
  """A form field's text as the type `VideoCreate` publishes for `name` (text when it is not one)."""
  field = api.VideoCreate.model_fields.get(name)
  extra = field.json_schema_extra if field is not None and isinstance(field.json_schema_extra, dict) else {}
  kinds = {option.get("type") for option in extra.get("anyOf", [])}
  stripped = text.strip()
  if "integer" in kinds and _INTEGER.fullmatch(stripped):
    return int(stripped)
  if "number" in kinds and "string" not in kinds and _NUMBER.fullmatch(stripped):
    return float(stripped)
  return text
