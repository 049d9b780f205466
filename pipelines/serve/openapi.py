"""What `/openapi.json` publishes beyond FastAPI's own: POST /v1/videos's two body forms (JSON and
`multipart/form-data`, one `VideoCreate` schema; the route reads its body itself, `forms`), the
error body (`api.ErrorBody`) on every status a route can answer, and no 422 (validation errors
are 400, as OpenAI's are).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pipelines.serve import api, previews

CONTENT_TYPES = (*dict.fromkeys(api.MEDIA_TYPES.values()), *(t for _, t in previews.VARIANTS.values()))
STATUS_TEXT = {400: "a bad request; `param` names the field", 401: "no or a wrong API key",
               404: "no such video, model or page", 409: "the video is not in a state that allows it",
               410: "the file is gone from the data folder", 413: "the body is over the server's limit",
               429: "the queue is full (see Retry-After)", 503: "the model failed to load"}


def errors(*statuses: int) -> dict[int, dict[str, Any]]:
  """FastAPI `responses=` entries: each status with OpenAI's error body."""
  return {status: {"model": api.ErrorBody, "description": STATUS_TEXT[status]} for status in statuses}


def create_body() -> dict[str, Any]:
  """POST /v1/videos's `requestBody` (its `openapi_extra`): JSON or a multipart form, one schema."""
  schema = api.VideoCreate.model_json_schema()
  form = {**schema, "properties": {**schema["properties"], "input_reference": {
      "type": "string", "format": "binary", "description": "the first frame: an image file (PNG, JPEG, WebP)"}}}
  return {"requestBody": {"required": True, "content": {
      "application/json": {"schema": schema},
      "multipart/form-data": {"schema": form, "encoding": {"input_reference": {"contentType": "image/*"}}}}}}


def publish(app: FastAPI) -> None:
  """Makes `app.openapi()` FastAPI's schema without its 422 responses (never sent here)."""
  default = app.openapi

  def openapi() -> dict[str, Any]:
    if app.openapi_schema is None:
      schema = default()
      for path in schema.get("paths", {}).values():
        for operation in path.values():
          operation.get("responses", {}).pop("422", None)
      for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
      app.openapi_schema = schema
    return app.openapi_schema

  app.openapi = openapi
