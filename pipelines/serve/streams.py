"""Streamed videos: `GET /v1/streams?prompt=...` (`&prompt_at=CHUNK:PROMPT`, repeatable: the prompt
from that chunk on, an interactive stream) answers with server-sent events that carry the video
as fragmented-MP4 segments while a causal stream makes it chunk by chunk (`generate --stream`'s
run, `pipeline.run.streaming.stream_video`), so a client plays the first chunk while the next is made.

Events (`text/event-stream`, each `data` one JSON object):
  start   {id, chunks, frames, fps, height, width}
  segment {index, frames, seconds, mime, data}   data: base64 of the MP4 bytes written since the last
          segment (the first begins with the init segment: ftyp + moov); appended in order to a
          MediaSource buffer of type `mime` (`video/mp4; codecs="avc1.PPCCLL"`, from the stream's avcC)
          they play as the file on disk does (every frame but the newest, which MP4 writes with the next)
  done    {id, frames, data}   the last bytes: with every segment before, the whole mp4
  error   {message}
The worker thread, which owns the devices, runs one stream at a time between batches; a client that
goes away stops its stream after the chunk being made. The mp4 stays in DATA/streams/ID.mp4.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import queue
import secrets
import threading
from collections.abc import Iterator
from typing import Any

from pipelines.commands.flags import UsageError, parse_prompts_at
from pipelines.pipeline.checked.seed import random_seed
from pipelines.serve import api
from pipelines.storage import video_io

EVENT_WAIT_S = 1.0  # the event reader's poll: how soon a gone client is noticed between chunks
DEFAULT_FRAMES = 33  # 3 chunks of 3 latent frames


@dataclasses.dataclass
class StreamSession:
  """One requested stream: what to make, and the queue its events go through (worker -> client)."""
  prompt: str
  height: int
  width: int
  num_frames: int
  seed: int
  window_frames: int | None = None
  prompts_at: dict[int, str] = dataclasses.field(default_factory=dict)  # {0-based chunk: prompt from then on}
  id: str = dataclasses.field(default_factory=lambda: "stream_" + secrets.token_hex(12))
  events: "queue.Queue[tuple[str, dict[str, Any]]]" = dataclasses.field(default_factory=queue.Queue)
  gone: threading.Event = dataclasses.field(default_factory=threading.Event)


def check_session(facts: Any, prompt: str, size: str | None, num_frames: int | None, seed: int | None,
                  window_frames: int | None, prompt_at: list[str] | None = None) -> StreamSession:
  """A session from the query's values, checked against the model (`facts`: a `ModelFacts`).

  Raises:
    api.ApiError: 400 naming the parameter (an empty prompt, a size that is not WxH in multiples of
      16, a frame count or window out of range, a negative seed), or "unsupported" where no mp4 can
      be encoded (`video_io.mp4_encoder_problem`).
  """
  if not prompt or not prompt.strip():
    raise api.ApiError(400, "prompt must be a non-empty string", "prompt")
  width, height = facts.defaults.width, facts.defaults.height
  if size is not None:
    try:
      width, height = (int(n) for n in size.lower().split("x"))
    except ValueError:
      raise api.ApiError(400, f"size={size!r} must be WIDTHxHEIGHT, e.g. 64x64", "size") from None
  if width <= 0 or height <= 0 or width % 16 or height % 16:
    raise api.ApiError(400, f"size={width}x{height}: width and height must be positive multiples of 16", "size")
  frames = DEFAULT_FRAMES if num_frames is None else num_frames
  if not 1 <= frames <= 16384:
    raise api.ApiError(400, f"num_frames={frames} must be in 1..16384", "num_frames")
  if seed is not None and seed < 0:
    raise api.ApiError(400, f"seed={seed} must be >= 0, or left out for a random one", "seed")
  if window_frames is not None and window_frames < 3:
    raise api.ApiError(400, f"window_frames={window_frames} must hold a chunk of 3 latent frames", "window_frames")
  try:
    later = parse_prompts_at(prompt_at or [], "prompt_at")
  except UsageError as e:
    raise api.ApiError(400, str(e), "prompt_at") from None
  problem = video_io.mp4_encoder_problem()  # a stream is an mp4: refused before any event, not as one
  if problem is not None:
    raise api.ApiError(400, f"a stream is an mp4 and this server cannot encode one: {problem}; install "
                       "imageio-ffmpeg where the server runs, or ask POST /v1/videos for a gif or npy",
                       code="unsupported")
  return StreamSession(prompt.strip(), height, width, frames, random_seed() if seed is None else seed,
                       window_frames, later)


def codec_mime(init: bytes) -> str:
  """The MediaSource type of an H.264 MP4 from its avcC box: `video/mp4; codecs="avc1.PPCCLL"`."""
  at = init.find(b"avcC")
  profile, compat, level = init[at + 5:at + 8] if at >= 0 else b"\x64\x00\x1f"
  return f'video/mp4; codecs="avc1.{profile:02x}{compat:02x}{level:02x}"'


def run_session(pipe: Any, session: StreamSession, data_dir: str, fps: float) -> None:
  """Makes the session's stream on the calling (worker) thread, putting its events on its queue
  (never raises: a failure is an `error` event)."""
  from pipelines.pipeline.run.streaming import StreamSettings, stream_video
  from pipelines.storage.stream_mp4 import StreamingMp4
  from pipelines.wan.causal import CacheWindow

  settings = StreamSettings(window=CacheWindow(3, session.window_frames, 0))
  chunks = settings.chunks_for(session.num_frames)
  path = os.path.join(data_dir, "streams", f"{session.id}.mp4")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  put = session.events.put
  writer = None
  try:
    writer = StreamingMp4(path, fps=fps, height=session.height, width=session.width)
    put(("start", {"id": session.id, "chunks": chunks, "frames": settings.frames_of(chunks, 3), "fps": fps,
                   "height": session.height, "width": session.width}))
    mime = None
    for chunk in stream_video(pipe, [session.prompt], num_chunks=chunks, height=session.height,
                              width=session.width, seed=session.seed, settings=settings,
                              prompts_at={k: [p] for k, p in session.prompts_at.items()}):
      writer.append(chunk.frames[0])
      data = writer.take_bytes()
      mime = mime or codec_mime(data)
      put(("segment", {"index": chunk.index, "frames": int(chunk.frames.shape[1]), "seconds": round(chunk.seconds, 3),
                       "mime": mime, "data": base64.b64encode(data).decode()}))
      if session.gone.is_set():
        raise ConnectionAbortedError("the client went away")
    frames = writer.close()[0]
    put(("done", {"id": session.id, "frames": frames, "data": base64.b64encode(writer.take_bytes()).decode()}))
  except Exception as e:  # noqa: BLE001 -- the client hears of it; the worker goes on
    if writer is not None:
      writer.abort()
    put(("error", {"message": f"{type(e).__name__}: {e}"}))


def sse(session: StreamSession) -> Iterator[str]:
  """The session's events as server-sent events, until `done` or `error`; a client that goes away
  (the generator closed) marks the session gone."""
  try:
    while True:
      try:
        name, data = session.events.get(timeout=EVENT_WAIT_S)
      except queue.Empty:
        yield ": waiting\n\n"  # a comment: keeps the connection alive, and notices a gone client
        continue
      yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
      if name in ("done", "error"):
        return
  finally:
    session.gone.set()
