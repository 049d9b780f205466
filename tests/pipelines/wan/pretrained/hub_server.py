"""A local stand-in for the Hugging Face Hub's file API, enough for huggingface_hub 2.x's
`hf_hub_download` and `snapshot_download` (read from its file_download.py, _snapshot_download.py,
hf_api.py and utils/_http.py):

  GET  /api/models/{org}/{name}/revision/{rev}     ModelInfo JSON: id, sha, siblings [{rfilename}]
  GET  /api/models/{org}/{name}/tree/{rev}[/...]   the tree listing (one page: no Link header)
  HEAD /{org}/{name}/resolve/{rev}/{path}          X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size,
                                                   Content-Length, Accept-Ranges
  GET  /{org}/{name}/resolve/{rev}/{path}          the bytes; a Range "bytes=N-" gets 206
  404s carry X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound as the Hub's do.
(huggingface_hub may also ask for /api/agent-harnesses, a registry it caches for a day; answered
404 and left out of the log.)

Every request is logged (`requests`: (method, path, Range header)); `cut[path] = n` makes the first
GET of that file stop after n bytes (the connection closed mid-body, as a dropped network does);
`delay_s` slows every file GET (so that two downloading processes overlap).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import urllib.parse


def commit_of(files: dict[str, bytes], salt: str = "") -> str:
  """A 40-hex commit id of a repo's files."""
  digest = hashlib.sha1(salt.encode())
  for path in sorted(files):
    digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
  return digest.hexdigest()


class FakeHub:
  """Serves `repos` ({repo id: {revision name or commit: {path: bytes}}}); the first revision of a
  repo is also its "main" unless "main" is given."""

  def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]]):
    self.repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
    for repo, revisions in repos.items():
      table = {}
      for name, files in revisions.items():
        commit = commit_of(files, repo + name)
        table[name] = table[commit] = (commit, files)
      table.setdefault("main", next(iter(table.values())))
      self.repos[repo] = table
    self.requests: list[tuple[str, str, str | None]] = []
    self.cut: dict[str, int] = {}
    self.delay_s = 0.0
    self._lock = threading.Lock()
    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
    self._server.daemon_threads = True
    self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

  def __enter__(self) -> FakeHub:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._server.shutdown()
    self._server.server_close()

  def commit(self, repo: str, revision: str = "main") -> str:
    return self.repos[repo][revision][0]

  def log(self, method: str, path: str, range_header: str | None) -> None:
    with self._lock:
      self.requests.append((method, path, range_header))

  def file_gets(self) -> list[str]:
    """The repo paths of every file GET, in order ("org/name:path")."""
    out = []
    for method, path, _ in self.requests:
      parts = path.split("/", 5)  # "", org, name, "resolve", rev, file
      if method == "GET" and len(parts) == 6 and parts[3] == "resolve":
        out.append(f"{parts[1]}/{parts[2]}:{urllib.parse.unquote(parts[5])}")
    return out

  def take_cut(self, path: str) -> int | None:
    with self._lock:
      return self.cut.pop(path, None)


def _etag(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _handler(hub: FakeHub) -> type[http.server.BaseHTTPRequestHandler]:

  class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
      pass

    def _answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
      self.send_response(status)
      for key, value in (headers or {}).items():
        self.send_header(key, value)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(body)

    def _missing(self, code: str, commit: str | None = None) -> None:
      headers = {"X-Error-Code": code, "X-Error-Message": code}
      if commit:
        headers["X-Repo-Commit"] = commit
      self._answer(404, json.dumps({"error": code}).encode(), headers)

    def _revision(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
      if repo not in hub.repos:
        self._missing("RepoNotFound")
        return None
      found = hub.repos[repo].get(urllib.parse.unquote(revision))
      if found is None:
        self._missing("RevisionNotFound")
      return found

    def do_HEAD(self) -> None:
      self.do_GET()

    def do_GET(self) -> None:
      path = urllib.parse.urlsplit(self.path).path
      if path == "/api/agent-harnesses":  # huggingface_hub's user-agent registry, fetched once a day: not the file API
        return self._answer(404, b"{}")
      hub.log(self.command, path, self.headers.get("Range"))
      parts = path.split("/")
      if parts[1:3] == ["api", "models"] and len(parts) >= 7:
        return self._api(f"{parts[3]}/{parts[4]}", parts[5], parts[6])
      if len(parts) >= 6 and parts[3] == "resolve":
        return self._file(f"{parts[1]}/{parts[2]}", parts[4], urllib.parse.unquote("/".join(parts[5:])))
      self._answer(404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def _api(self, repo: str, kind: str, revision: str) -> None:
      found = self._revision(repo, revision)
      if found is None:
        return
      commit, files = found
      if kind == "revision":
        body = {"id": repo, "sha": commit, "private": False,
                "siblings": [{"rfilename": name} for name in sorted(files)]}
      else:  # tree, recursive
        body = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in sorted(files.items())]
      self._answer(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, repo: str, revision: str, name: str) -> None:
      found = self._revision(repo, revision)
      if found is None:
        return
      commit, files = found
      if name not in files:
        return self._missing("EntryNotFound", commit)
      data = files[name]
      headers = {"X-Repo-Commit": commit, "ETag": f'"{_etag(data)}"', "X-Linked-Etag": f'"{_etag(data)}"',
                 "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
      if self.command == "HEAD":
        return self._head(data, headers)
      if hub.delay_s:
        threading.Event().wait(hub.delay_s)
      start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
      status = 206 if start else 200
      if start:
        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
      body = data[start:]
      cut = hub.take_cut(name)
      if cut is None:
        return self._answer(status, body, headers)
      self.send_response(status)  # the whole length announced, `cut` bytes sent, the connection dropped
      for key, value in headers.items():
        self.send_header(key, value)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body[:cut])
      self.wfile.flush()
      self.close_connection = True

    def _head(self, data: bytes, headers: dict[str, str]) -> None:
      self.send_response(200)
      for key, value in headers.items():
        self.send_header(key, value)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()

  return Handler


def point_huggingface_hub_at(url: str, cache: str, monkeypatch) -> None:
  """huggingface_hub (in this process and in processes started from it) talks to `url` and caches in
  `cache`: the environment variables a user sets (HF_ENDPOINT, HF_HUB_CACHE), and, since
  huggingface_hub reads them once at import, the values it took from them."""
  from huggingface_hub import constants

  for name, value in (("HF_ENDPOINT", url), ("HF_HUB_CACHE", cache)):
    monkeypatch.setenv(name, value)
  for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "TRANSFORMERS_OFFLINE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(constants, "ENDPOINT", url)
  monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
  monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def download_in_child(repo: str, barrier, results) -> None:
  """A child process's download (multiprocessing target): waits for its sibling at `barrier`, then
  puts its snapshot's (commit, folder) into `results`."""
  from pipelines.wan.pretrained import download_snapshot

  barrier.wait(timeout=60)
  snapshot = download_snapshot(repo)
  results.put((snapshot.commit, snapshot.folder))
