"""Tests for pipelines/serve/openapi.py: the published schema, fuzzed with schemathesis (bounded, on the
ASGI app of a server whose model is not loaded: requests are checked and queued, nothing runs).

Every operation of /openapi.json gets schema-driven requests (valid and invalid ones): no 5xx,
every status, content type, header and body as the schema says, and schema-invalid requests
refused. Schema-valid requests may still be refused (400): the model's own rules (sizes on its
grid, 4k + 1 frames, text without control characters) go beyond a JSON schema.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from pipelines.serve.app import create_app  # noqa: E402
from pipelines.serve.main import model_facts  # noqa: E402
from pipelines.serve.options import ServeConfig  # noqa: E402
from pipelines.serve.service import Service  # noqa: E402

EXAMPLES = 30  # per operation (12 operations): bounded, ~10 s on 2 cores


def _app(tmp_path, **config):
  config = ServeConfig(model="tiny", data_dir=str(tmp_path), max_queue=10_000, **config)
  service = Service(config, model_facts(config), load=None)
  service.state = "ready"
  service.ready.set()  # /health answers 200 (its 503 is for a server still loading)
  return service, create_app(service)


def test_schemathesis_finds_no_server_error_or_schema_violation(tmp_path):
  service, app = _app(tmp_path)
  schema = schemathesis.openapi.from_asgi("/openapi.json", app)
  # GET /v1/streams needs the worker thread this service has not started (it answers 503, a server
  # error to schemathesis, or a valid query streams for minutes): its 400s are tested in test_streams.py.
  operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.path != "/v1/streams"]
  assert len(operations) >= 12, [op.label for op in operations]
  try:
    for operation in operations:
      @given(case=operation.as_strategy())
      @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
      def check(case):
        case.call_and_validate(excluded_checks=[schemathesis.checks.positive_data_acceptance])

      check()
  finally:
    service.store.close()


def test_schema_publishes_both_body_forms_and_the_error_body(tmp_path):
  service, app = _app(tmp_path)
  client = TestClient(app)
  schema = client.get("/openapi.json").json()
  create = schema["paths"]["/v1/videos"]["post"]
  assert set(create["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
  form = create["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
  assert form["input_reference"]["format"] == "binary" and "prompt" in form
  assert {"400", "413", "429"} <= set(create["responses"]) and "422" not in create["responses"]
  assert create["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
  listing = {p["name"]: p for p in schema["paths"]["/v1/videos"]["get"]["parameters"]}
  assert listing["order"]["schema"]["enum"] == ["asc", "desc"]
  assert client.get("/docs").status_code == 200 and client.get("/redoc").status_code == 200
  service.store.close()
  quiet, app = _app(tmp_path / "quiet", docs=False)  # serve --no-docs: no schema, no pages, no assets
  client = TestClient(app)
  for path in ("/openapi.json", "/docs", "/redoc", "/docs-assets/swagger-ui-bundle.js"):
    answer = client.get(path)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", (path, answer.text)
  quiet.store.close()
