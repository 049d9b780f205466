"""The HTTP routes (FastAPI): OpenAI's Videos API shape, health, metrics and the web page.

  POST   /v1/videos               queue a video (VideoCreate) -> the video object, status "queued"
  GET    /v1/videos               newest first: ?limit=20&after=ID -> {object: "list", data, has_more, ...}
  GET    /v1/videos/{id}          status, progress %, step, timings, error
  GET    /v1/videos/{id}/content  the video file (once completed)
  POST   /v1/videos/{id}/cancel   cancel a queued or running job -> the video object; 409 once it finished
  DELETE /v1/videos/{id}          cancel a queued or running job; forget (and delete) a finished one
  GET    /health                  200 once the model is loaded and warmed up, else 503 (no auth)
  GET    /metrics                 Prometheus text
  GET    /                        the web page (no auth; it asks for the key when the API does)

With an API key every route but /health and / needs `Authorization: Bearer KEY`. Errors have
OpenAI's body {"error": {"message", "type", "param", "code"}}; `param` names the field at fault.
A client that means "stop it" (the page's Cancel) uses POST .../cancel: a job that finished before
the request arrived stays as it is (409 "not_cancellable" naming its status), where DELETE would forget it.
"""

from __future__ import annotations

import json
import re
import secrets
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from pipelines.serve import api

JOB_ID = re.compile(r"video_[0-9a-f]{24}")


def _validation_error(errors: list[dict[str, Any]]) -> api.ApiError:
  first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
  field = ".".join(str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")) or None
  what = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
  return api.ApiError(400, f"{field or 'body'}: {what}", field)


async def _read_body(request: Request, limit: int) -> bytes:
  """The request body, refused (413) past `limit` bytes before more is read."""
  declared = request.headers.get("content-length")
  if declared is not None and (not declared.isdigit() or int(declared) > limit):
    raise api.ApiError(413, f"the request body is over this server's limit of {limit} bytes", code="too_large")
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > limit:
      raise api.ApiError(413, f"the request body is over this server's limit of {limit} bytes", code="too_large")
  return bytes(body)


def parse_create(raw: bytes) -> api.VideoCreate:
  """A POST body as a `VideoCreate`.

  Raises:
    api.ApiError: not a JSON object, or a field of the wrong kind or unknown (naming it).
  """
  try:
    data = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise api.ApiError(400, f"the body is not JSON ({e}); send a JSON object like {{\"prompt\": \"...\"}}") from e
  if not isinstance(data, dict):
    raise api.ApiError(400, f"the body must be a JSON object, not a {type(data).__name__}")
  try:
    return api.VideoCreate.model_validate(data)
  except ValidationError as e:
    raise _validation_error(e.errors()) from e


def _job(service: Any, job_id: str) -> dict[str, Any]:
  row = service.store.get(job_id) if JOB_ID.fullmatch(job_id) else None
  if row is None:
    raise api.ApiError(404, f"no video {job_id!r}", "video_id", code="not_found")
  return row


def create_app(service: Any) -> FastAPI:
  """The FastAPI app over a `service.Service` (routes in this module's docstring)."""
  app = FastAPI(title="wan-usp-jax serve", docs_url=None, redoc_url=None, openapi_url=None)
  key = service.config.api_key

  def authorized(request: Request) -> None:
    if key is None:
      return
    given = request.headers.get("authorization", "")
    if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), key.encode())):
      raise api.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="unauthorized")

  @app.exception_handler(api.ApiError)
  async def api_error(request: Request, e: api.ApiError) -> JSONResponse:
    headers = {"Retry-After": str(service.retry_after())} if e.status == 429 else None
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else headers
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    error = _validation_error(list(e.errors()))
    return JSONResponse(error.body(), status_code=error.status)

  _add_video_routes(app, service, Depends(authorized))

  @app.get("/health")
  def health() -> JSONResponse:
    return JSONResponse(service.health(), status_code=200 if service.ready.is_set() else 503)

  @app.get("/metrics", dependencies=[Depends(authorized)])
  def metrics() -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  @app.get("/", response_class=HTMLResponse)
  def page() -> HTMLResponse:
    return HTMLResponse(resources.files("pipelines.serve").joinpath("static/index.html").read_text("utf-8"))

  return app


def _add_video_routes(app: FastAPI, service: Any, auth: Any) -> None:
  model = service.facts.name

  @app.post("/v1/videos", dependencies=[auth])
  async def create(request: Request) -> JSONResponse:
    body = parse_create(await _read_body(request, service.config.max_body_bytes))
    row = service.submit(body)
    return JSONResponse(api.video_object(row, model), status_code=200)

  @app.get("/v1/videos", dependencies=[auth])
  def listing(limit: int = Query(20, ge=1, le=100), after: str | None = Query(None, max_length=64)) -> dict:
    page = service.store.page(limit, after)
    if page is None:
      raise api.ApiError(404, f"after={after!r}: no such video (pass the id of a listed video)", "after",
                         code="not_found")
    rows, more = page
    data = [api.video_object(r, model) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}

  @app.get("/v1/videos/{video_id}", dependencies=[auth])
  def retrieve(video_id: str) -> dict:
    return api.video_object(_job(service, video_id), model)

  @app.get("/v1/videos/{video_id}/content", dependencies=[auth])
  def content(video_id: str) -> FileResponse:
    row = _job(service, video_id)
    if row["status"] != "completed":
      raise api.ApiError(409, f"video {video_id!r} is {row['status']}, not completed; poll GET /v1/videos/{video_id}",
                         "video_id", code="not_ready")
    path = service.content_path(row)
    if path is None:
      raise api.ApiError(410, f"the file of video {video_id!r} is gone from the data folder", "video_id", code="gone")
    kind = row["params"]["output_format"]
    return FileResponse(path, media_type=api.MEDIA_TYPES[kind], filename=f"{video_id}.{kind}")

  @app.post("/v1/videos/{video_id}/cancel", dependencies=[auth])
  def cancel(video_id: str) -> dict:
    _job(service, video_id)
    if not service.store.cancel(video_id):
      status = (service.store.get(video_id) or {"status": "deleted"})["status"]
      raise api.ApiError(409, f"video {video_id!r} is {status} already; only a queued or in_progress video can be "
                         "cancelled", "video_id", code="not_cancellable")
    return api.video_object(service.store.get(video_id), model)

  @app.delete("/v1/videos/{video_id}", dependencies=[auth])
  def delete(video_id: str) -> dict:
    row = _job(service, video_id)
    if service.store.cancel(video_id):
      return api.video_object(service.store.get(video_id), model)
    removed = service.store.delete(video_id)
    if removed is not None:
      service.remove_files(removed)
    return {"id": video_id, "object": "video.deleted", "deleted": removed is not None, "status": row["status"]}
