"""Bytes on disk: safetensors weight folders (`weights`), atomic writes and video files (`video_io`).

Imports nothing from the rest of `pipelines`."""
