"""`serve`'s web page in headless Chromium against a real server process: a prompt typed and submitted
on the page becomes a finished video that plays in the page (loaded, the requested size and length,
its bytes the job's content, its first frame as ffmpeg decodes it); the page's Cancel buttons cancel
a queued and a running job.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package (skipped, naming the
install command, without them). One tiny-default server: the video 32x32 x 5 frames x 3 steps, the
cancelled jobs 64x64 x 17 frames x 500 steps (seconds long); screenshots in tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from tests.harness import REPO_ROOT, free_port, serve_process, wait_healthy

ROOT = REPO_ROOT
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's packages
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver && .venv/bin/pip install selenium"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--window-size=900,760")
SIZE, FRAMES, STEPS, FPS = (32, 32), 5, 3, 16  # FPS: the API's default


def _browser(profile: str):
  """A selenium WebDriver of headless Chromium with a fresh profile; skips without one."""
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
  except ImportError:
    pytest.skip(f"selenium is not installed; for the browser test: {INSTALL}")
  if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no {CHROMIUM} / {CHROMEDRIVER}; for the browser test: {INSTALL}")
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for flag in FLAGS + (f"--user-data-dir={profile}",):
    options.add_argument(flag)
  return webdriver.Chrome(options=options, service=DriverService(CHROMEDRIVER))


@pytest.fixture(scope="module")
def page(tmp_path_factory):
  """(driver at `/`, httpx client) of a `serve` process of the tiny default, its 32x32x5x3 shape
  compiled by --warmup."""
  import httpx

  root = tmp_path_factory.mktemp("browser")
  driver = _browser(str(root / "profile"))
  port = free_port()
  process = serve_process(ROOT, str(root / "data"), port, "--max-batch", "1",
                          "--warmup", f"{SIZE[0]}x{SIZE[1]}x{FRAMES}x{STEPS}")
  try:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
      wait_healthy(client, process)
      driver.get(f"http://127.0.0.1:{port}/")
      yield driver, client
  finally:
    driver.quit()
    process.terminate()
    process.wait(60)


def until(condition, what: str, timeout: float = 60.0, every: float = 0.05):
  """condition()'s first truthy value; fails naming `what` after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not (value := condition()):
    assert time.monotonic() < deadline, f"after {timeout} s: {what}"
    time.sleep(every)
  return value


def fill(driver, **fields) -> None:
  """Types each value into the form field of that id (clearing it first)."""
  from selenium.webdriver.common.by import By
  for name, value in fields.items():
    field = driver.find_element(By.ID, name)
    field.clear()
    field.send_keys(str(value))


def submit(driver, client, prompt: str, **fields) -> str:
  """Submits the form with `prompt` and `fields`; returns the new job's id (from the API)."""
  from selenium.webdriver.common.by import By
  before = {job["id"] for job in client.get("/v1/videos").json()["data"]}
  fill(driver, prompt=prompt, **fields)
  driver.find_element(By.CSS_SELECTOR, "#create button[type=submit]").click()
  new = until(lambda: [j for j in client.get("/v1/videos").json()["data"] if j["id"] not in before],
              "the submitted job is not listed")
  assert len(new) == 1 and new[0]["prompt"] == prompt, new
  return new[0]["id"]


def status_text(driver, job_id: str) -> str:
  return driver.execute_script(
      "const cell = document.querySelector(`#job-${arguments[0]} .status`); return cell && cell.textContent;",
      job_id) or ""


VIDEO_STATE = """
const video = document.querySelector(`#job-${arguments[0]} video`);
return video && {readyState: video.readyState, duration: video.duration, width: video.videoWidth,
                 height: video.videoHeight, error: video.error && video.error.message, src: video.src,
                 currentTime: video.currentTime, paused: video.paused};
"""

# The video's bytes (its blob fetched again) and its first frame drawn on a canvas (RGBA, row-major).
VIDEO_BYTES_AND_FIRST_FRAME = """
const [id, done] = [arguments[0], arguments[arguments.length - 1]];
const video = document.querySelector(`#job-${id} video`);
(async () => {
  const bytes = Array.from(new Uint8Array(await (await fetch(video.src)).arrayBuffer()));
  video.pause();
  await new Promise((resolve) => { video.addEventListener("seeked", resolve, {once: true}); video.currentTime = 0; });
  const canvas = document.createElement("canvas");
  [canvas.width, canvas.height] = [video.videoWidth, video.videoHeight];
  const context = canvas.getContext("2d");
  context.drawImage(video, 0, 0);
  done({bytes, rgba: Array.from(context.getImageData(0, 0, canvas.width, canvas.height).data)});
})().catch((e) => done({error: String(e)}));
"""


# A row of the job as if still running, its Cancel button's handler run to its end.
STALE_CANCEL = """
const [id, done] = [arguments[0], arguments[arguments.length - 1]];
(async () => {
  const job = await (await fetch(`/v1/videos/${id}`)).json();
  const stale = row(Object.assign({}, job, {status: "in_progress", progress: 50}));
  document.getElementById("jobs").prepend(stale);
  await stale.querySelector("button").onclick();
  done({message: document.getElementById("message").textContent,
        rows: document.querySelectorAll(`#job-${id}`).length});
})().catch((e) => done({error: String(e)}));
"""


def first_frame(mp4: bytes, height: int, width: int) -> np.ndarray:
  """uint8 [H, W, 3]: the first frame of `mp4` as imageio-ffmpeg's ffmpeg decodes it."""
  import imageio_ffmpeg
  done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", "-", "-frames:v", "1", "-f", "rawvideo",
                         "-pix_fmt", "rgb24", "-"], input=mp4, capture_output=True, check=True)
  return np.frombuffer(done.stdout, np.uint8).reshape(height, width, 3)


def test_prompt_submitted_on_the_page_plays_as_a_video(page, tmp_path):
  driver, client = page
  driver.set_script_timeout(30)
  job_id = submit(driver, client, "a red square moving right", size=f"{SIZE[0]}x{SIZE[1]}", num_frames=FRAMES,
                  num_inference_steps=STEPS, seed=1)
  until(lambda: status_text(driver, job_id) == "completed", f"the page shows job {job_id} completed")
  job = client.get(f"/v1/videos/{job_id}").json()
  assert job["status"] == "completed" and job["size"] == "32x32" and job["num_frames"] == FRAMES, job
  state = until(lambda: (s := driver.execute_script(VIDEO_STATE, job_id)) and s["readyState"] >= 2 and s,
                "the video element has its current frame (readyState >= HAVE_CURRENT_DATA)", timeout=20)
  assert state["error"] is None and state["src"].startswith("blob:"), state
  assert (state["width"], state["height"]) == SIZE, state
  assert state["duration"] == pytest.approx(FRAMES / FPS, abs=1e-3), state
  until(lambda: driver.execute_script(VIDEO_STATE, job_id)["currentTime"] > 0, "the video plays (autoplay)", 10)
  driver.save_screenshot(str(tmp_path / "completed.png"))
  shown = driver.execute_async_script(VIDEO_BYTES_AND_FIRST_FRAME, job_id)
  assert "error" not in shown, shown
  content = client.get(f"/v1/videos/{job_id}/content").content
  assert bytes(shown["bytes"]) == content  # the page shows this job's video
  browser = np.asarray(shown["rgba"], np.uint8).reshape(SIZE[1], SIZE[0], 4)
  ffmpeg = first_frame(content, SIZE[1], SIZE[0])
  difference = np.abs(browser[..., :3].astype(int) - ffmpeg.astype(int))
  print(f"first frame, Chromium vs ffmpeg: mean |diff| {difference.mean():.2f}, max {difference.max()} (of 255); "
        f"frame std {ffmpeg.std():.1f}")
  assert (browser[..., 3] == 255).all() and ffmpeg.std() > 5  # a drawn frame, not a blank one
  mirrored = np.abs(browser[:, ::-1, :3].astype(int) - ffmpeg.astype(int)).mean()
  assert difference.mean() < 2 and difference.max() <= 8 and mirrored > 5 * difference.mean(), (difference, mirrored)
  # A Cancel button drawn while the job ran, clicked after it finished: the cancel route's 409 leaves
  # the video (DELETE would delete a finished job), no error shown, the row redrawn as completed.
  stale = driver.execute_async_script(STALE_CANCEL, job_id)
  assert stale["message"] == "" and stale["rows"] == 1, stale
  assert client.get(f"/v1/videos/{job_id}/content").content == content
  until(lambda: status_text(driver, job_id) == "completed", f"the page shows job {job_id} completed again", 10)


def test_cancel_buttons_cancel_a_queued_and_a_running_job(page, tmp_path):
  driver, client = page
  long = dict(size="64x64", num_frames=17, num_inference_steps=500, seed=2)
  running = submit(driver, client, "a blue circle moving up", **long)
  queued = submit(driver, client, "a green triangle standing still", **long)
  until(lambda: re.search(r"in_progress [1-9]\d*/500", status_text(driver, running))
        and "queued" in status_text(driver, queued), "the page shows one job past its first step, one queued")
  t0 = time.monotonic()
  for job_id in (queued, running):  # at once: the running one has seconds of steps to go
    driver.execute_script("document.querySelector(`#job-${arguments[0]} button`).click();", job_id)
  for job_id in (queued, running):
    until(lambda: status_text(driver, job_id) == "cancelled", f"the page shows job {job_id} cancelled", 30)
  jobs = {job_id: client.get(f"/v1/videos/{job_id}").json() for job_id in (queued, running)}
  assert jobs[queued]["status"] == "cancelled" and jobs[queued]["step"] == 0, jobs
  print(f"cancelled {time.monotonic() - t0:.2f} s after the clicks, the running job at step {jobs[running]['step']}")
  assert jobs[running]["status"] == "cancelled" and jobs[running]["step"] < 500, jobs
  assert not driver.find_elements("css selector", f"#job-{running} button")  # no Cancel left
  driver.save_screenshot(str(tmp_path / "cancelled.png"))


LIVE_STATE = """
const video = document.getElementById("live-video");
return {chunks: parseInt(document.getElementById("live").dataset.chunks || "0", 10), readyState: video.readyState,
        buffered: video.buffered.length ? video.buffered.end(0) : 0, error: video.error && video.error.message,
        message: document.getElementById("message").textContent,
        status: document.getElementById("live-status").textContent};
"""


def test_the_stream_button_plays_the_video_while_it_is_made(page):
  """Stream (GET /v1/streams, 64x64, 50 chunks of 12 frames): the page's video has frames to show
  (readyState >= 2, a buffered range) while chunks are still being made, and ends with every frame
  (597 at 16 fps: 37.3 s buffered)."""
  from selenium.webdriver.common.by import By

  driver, _ = page
  fill(driver, prompt="a red square moving right", size="64x64", num_frames=597, seed=2)
  driver.find_element(By.ID, "stream").click()
  early = until(lambda: (s := driver.execute_script(LIVE_STATE)) and (s["error"] or s["message"] or (
      s["readyState"] >= 2 and s["buffered"] > 0 and s)), "the streamed video has a frame to show", 120)
  assert early.get("chunks", 0) < 50 and not early.get("error") and not early.get("message"), early
  done = until(lambda: "done" in (s := driver.execute_script(LIVE_STATE))["status"] and s,
               "the stream ends", 300)
  assert done["chunks"] == 50 and abs(done["buffered"] - 597 / FPS) < 0.2, done
