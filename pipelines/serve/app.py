"""The HTTP routes (FastAPI): OpenAI's Videos API as its official SDK speaks it, models, health,
metrics, the web page, and the published schema.

  POST   /v1/videos                 queue a video: JSON or multipart/form-data (`forms`), with an
                                    optional input_reference image or video -> the video object, "queued"
  GET    /v1/videos                 ?order=desc|asc&limit=20&after=ID -> {object: "list", data, has_more, ...}
  GET    /v1/videos/{id}            status, progress %, step, timings, error
  GET    /v1/videos/{id}/content    ?variant=video|thumbnail|spritesheet (once completed)
  POST   /v1/videos/{id}/remix      a new video from a finished one's video and a new prompt (video-to-video)
  POST   /v1/videos/{id}/cancel     cancel a queued or running job -> the video object; 409 once it finished
  DELETE /v1/videos/{id}            forget a job and delete its files, whatever its status (a queued or running
                                    one never finishes) -> {id, object: "video.deleted", deleted: true, status}
  GET    /v1/streams                ?prompt=...&size=WxH&num_frames=N&seed=S -> server-sent events carrying the
                                    video as fragmented-MP4 segments while a causal stream makes it (`streams`)
  GET    /v1/models[/{id}]          the served model
  GET    /health                    200 once the model is loaded and warmed up, else 503 (no auth)
  GET    /metrics                   Prometheus text
  GET    /                          the web page (no auth; it asks for the key when the API does)
  GET    /openapi.json, /docs, /redoc   the schema and its pages, their scripts served from /docs-assets, so
                                    they work offline (no auth; `serve --no-docs`: none)

With an API key every route but /health, / and the schema needs `Authorization: Bearer KEY`. Every
error, unknown routes and methods and server faults included, has OpenAI's body {"error":
{"message", "type", "param", "code"}}; `param` names the field at fault. A client that means "stop
it" (the page's Cancel) uses POST .../cancel: a job that finished before the request arrived stays
as it is (409 "not_cancellable" naming its status), where DELETE would forget it and its video.
"""

from __future__ import annotations

import secrets
import time
import traceback
from importlib import resources
from typing import Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipelines.serve import api, forms, previews, streams
from pipelines.serve.openapi import CONTENT_TYPES, create_body, errors, publish

JOB_ID = api.JOB_ID
DOCS_ASSETS = "/docs-assets"  # where /docs and /redoc load their scripts, stylesheet and icon from
POLL_AFTER_MS = 500  # the SDK's poll() waits this long between status requests (header openai-poll-after-ms)


def _not_found(job_id: str) -> api.ApiError:
  return api.ApiError(404, f"no video {api.sendable(job_id)!r}", "video_id", code="not_found")


def _job(service: Any, job_id: str) -> dict[str, Any]:
  row = service.store.get(job_id) if JOB_ID.fullmatch(job_id) else None
  if row is None:
    raise _not_found(job_id)
  return row


def create_app(service: Any) -> FastAPI:
  """The FastAPI app over a `service.Service` (routes in this module's docstring)."""
  about = {"title": "wan-usp-jax serve", "version": "1", "summary": "Wan video generation, OpenAI's Videos API"}
  if service.config.docs:
    # The pages' scripts, stylesheet and icon come with the fastapi-offline package (FastAPI's own pages
    # load them from a CDN: blank offline); Swagger UI's validator badge would call validator.swagger.io.
    app = FastAPIOffline(**about, static_url=DOCS_ASSETS, swagger_ui_parameters={"validatorUrl": None})
  else:
    app = FastAPI(**about, docs_url=None, redoc_url=None, openapi_url=None)
  key = service.config.api_key

  def authorized(request: Request) -> None:
    if key is None:
      return
    given = request.headers.get("authorization", "")
    if not (given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), key.encode())):
      raise api.ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="unauthorized")

  _add_error_handlers(app, service)
  _add_video_routes(app, service, Depends(authorized))
  _add_other_routes(app, service, Depends(authorized))
  publish(app)
  return app


def _add_error_handlers(app: FastAPI, service: Any) -> None:
  @app.exception_handler(api.ApiError)
  async def api_error(request: Request, e: api.ApiError) -> JSONResponse:
    headers = {"Retry-After": str(service.retry_after())} if e.status == 429 else None
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else headers
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(RequestValidationError)
  async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    error = forms.validation_error(list(e.errors()))
    return JSONResponse(error.body(), status_code=error.status)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    what = {404: f"no route {request.method} {request.url.path}; the API is under /v1 (GET /openapi.json lists it)",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
    error = api.ApiError(e.status_code, what, code=code)
    return JSONResponse(error.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

  @app.exception_handler(Exception)
  async def fault(request: Request, e: Exception) -> JSONResponse:
    traceback.print_exception(e)
    error = api.ApiError(500, f"the server failed on this request ({type(e).__name__}); its log has the details",
                         code="server_error")
    return JSONResponse(error.body(), status_code=500)


def _add_video_routes(app: FastAPI, service: Any, auth: Any) -> None:
  model = service.facts.name

  def shown(row: dict[str, Any]) -> dict[str, Any]:
    return api.video_object(row, model)

  @app.post("/v1/videos", dependencies=[auth], response_model=api.VideoObject, openapi_extra=create_body(),
            responses=errors(400, 401, 413, 429, 503), summary="Queue a video")
  async def create(request: Request) -> JSONResponse:
    body, upload = await forms.read_create(request, service.config)
    return JSONResponse(shown(service.submit(body, upload)), status_code=200)

  @app.get("/v1/videos", dependencies=[auth], response_model=api.VideoList, responses=errors(400, 401, 404),
           summary="List videos")
  def listing(limit: int = Query(20, ge=1, le=100), after: str | None = Query(None, max_length=64),
              order: Literal["asc", "desc"] = Query("desc", description="by creation: desc newest first")) -> dict:
    page = service.store.page(limit, after, order)
    if page is None:
      raise api.ApiError(404, f"after={api.sendable(after)!r}: no such video (pass the id of a listed video)",
                         "after", code="not_found")
    rows, more = page
    data = [shown(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}

  @app.get("/v1/videos/{video_id}", dependencies=[auth], response_model=api.VideoObject,
           responses=errors(401, 404), summary="A video's status")
  def retrieve(video_id: str) -> JSONResponse:
    return JSONResponse(shown(_job(service, video_id)), headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

  @app.get("/v1/videos/{video_id}/content", dependencies=[auth], response_class=Response,
           responses={200: {"description": "the video or a still", "content": {t: {} for t in CONTENT_TYPES}},
                      **errors(400, 401, 404, 409, 410)}, summary="Download a video or its previews")
  def content(video_id: str, variant: Literal["video", "thumbnail", "spritesheet"] = Query("video")) -> Response:
    row = _job(service, video_id)
    if row["status"] != "completed":
      raise api.ApiError(409, f"video {video_id!r} is {row['status']}, not completed; poll GET /v1/videos/{video_id}",
                         "video_id", code="not_ready")
    path = service.content_path(row, variant)
    if path is None:
      raise api.ApiError(410, f"the {variant} of video {video_id!r} is gone from the data folder", "variant",
                         code="gone")
    if variant != "video":
      extension, media_type = previews.VARIANTS[variant]
      return FileResponse(path, media_type=media_type, filename=f"{video_id}.{variant}.{extension}")
    kind = row["params"]["output_format"]
    return FileResponse(path, media_type=api.MEDIA_TYPES[kind], filename=f"{video_id}.{kind}")

  _add_job_actions(app, service, auth, shown)


def _add_job_actions(app: FastAPI, service: Any, auth: Any, shown: Any) -> None:
  """remix, cancel and delete of one job."""

  @app.post("/v1/videos/{video_id}/remix", dependencies=[auth], response_model=api.VideoObject,
            responses=errors(400, 401, 404, 409, 410, 429, 503), summary="Remix a finished video (video-to-video)")
  def remix(video_id: str, body: api.VideoRemix) -> dict:
    row = _job(service, video_id)
    api.check_text("prompt", body.prompt)
    return shown(service.remix(row, body))

  @app.post("/v1/videos/{video_id}/cancel", dependencies=[auth], response_model=api.VideoObject,
            responses=errors(401, 404, 409), summary="Cancel a queued or running video")
  def cancel(video_id: str) -> dict:
    _job(service, video_id)
    if not service.store.cancel(video_id):
      status = (service.store.get(video_id) or {"status": "deleted"})["status"]
      raise api.ApiError(409, f"video {video_id!r} is {status} already; only a queued or in_progress video can be "
                         "cancelled", "video_id", code="not_cancellable")
    return shown(service.store.get(video_id))

  @app.delete("/v1/videos/{video_id}", dependencies=[auth], response_model=api.VideoDeleted,
              responses=errors(401, 404), summary="Delete a video: cancel it if it is queued or running, and forget it")
  def delete(video_id: str) -> dict:
    removed = service.delete(video_id) if JOB_ID.fullmatch(video_id) else None
    if removed is None:
      raise _not_found(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True, "status": removed["status"]}


def _add_other_routes(app: FastAPI, service: Any, auth: Any) -> None:
  started = int(time.time())

  def model_object() -> dict[str, Any]:
    return {"id": service.facts.name, "object": "model", "created": started, "owned_by": "wan-usp-jax"}

  @app.get("/v1/models", dependencies=[auth], response_model=api.ModelList, responses=errors(401),
           summary="The served model")
  def models() -> dict:
    return {"object": "list", "data": [model_object()]}

  @app.get("/v1/models/{model_id}", dependencies=[auth], response_model=api.ModelObject, responses=errors(401, 404),
           summary="The served model, by id")
  def model(model_id: str) -> dict:
    if model_id != service.facts.name:
      raise api.ApiError(404, f"no model {api.sendable(model_id)!r}; this server serves {service.facts.name!r}",
                         "model", code="not_found")
    return model_object()

  @app.get("/v1/streams", dependencies=[auth], response_class=StreamingResponse,
           responses={200: {"description": "server-sent events: start, segment..., done (streams.py)",
                            "content": {"text/event-stream": {}}}, **errors(400, 401, 503)},
           summary="Stream a video as it is made (fragmented MP4 in server-sent events)")
  def stream(prompt: str, size: str | None = None, num_frames: int | None = None, seed: int | None = None,
             window_frames: int | None = None, prompt_at: list[str] = Query([])) -> StreamingResponse:
    session = streams.check_session(service.facts, prompt, size, num_frames, seed, window_frames, prompt_at)
    if service.worker is None or not service.ready.is_set():
      raise api.ApiError(503, f"the model is {service.state}; retry once GET /health answers 200", code="not_ready")
    service.worker.streams.put(session)
    service.worker.wake.set()
    return StreamingResponse(streams.sse(session), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

  @app.get("/health", responses={503: {"description": "loading, warming up, or failed"}}, summary="Ready or not")
  def health() -> JSONResponse:
    return JSONResponse(service.health(), status_code=200 if service.ready.is_set() else 503)

  @app.get("/metrics", dependencies=[auth], response_class=Response, responses={
      200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}}, **errors(401)}, summary="Prometheus metrics")
  def metrics() -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  @app.get("/", response_class=HTMLResponse, summary="The web page")
  def page() -> HTMLResponse:
    return HTMLResponse(resources.files("pipelines.serve").joinpath("static/index.html").read_text("utf-8"))
