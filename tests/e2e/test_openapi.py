"""schemathesis against the OpenAPI description the gateway serves (`GET /openapi.yaml`):
thousands of generated requests, valid and not, to every operation it documents, bounded
in time. No answer may be a server error, except the older template-build APIs, which answer
501 by design (this gateway builds through `/v3/templates`, as E2B SDK 2.x does). Installed
into `.venv-schemathesis` by scripts/test-all (pinned in requirements-schemathesis.txt)."""

import json
import re
import subprocess
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = ROOT / ".venv-schemathesis" / "bin" / "schemathesis"
# Documented paths that also answer POST with 501: the pre-v3 template builds.
LEGACY_BUILDS = {"POST /templates", "POST /v2/templates", "POST /templates/{templateID}"}
# Creates answer 503 ("not now", with Retry-After) once the sandboxes schemathesis made fill
# the stack's nodes.
CREATES = {"POST /sandboxes", "POST /v2/sandboxes"}
# Resuming a paused sandbox places it again, and so answers the same 503 once they are full.
RESUMES = {
    "POST /sandboxes/{sandboxID}/resume",
    "POST /sandboxes/{sandboxID}/connect",
    "POST /v2/sandboxes/{sandboxID}/connect",
}
# The server errors allowed, by status and a word of their message.
BY_DESIGN = {"501": "not supported", "503": "no node fits"}


def _kill_all(url: str, key: str):
    request = urllib.request.Request(f"{url}/sandboxes?limit=1000", headers={"X-API-Key": key})
    with urllib.request.urlopen(request, timeout=10) as answer:
        listed = json.load(answer)
    for sandbox in listed:
        kill = urllib.request.Request(
            f"{url}/sandboxes/{sandbox['sandboxID']}", method="DELETE", headers={"X-API-Key": key}
        )
        urllib.request.urlopen(kill, timeout=30).close()


def test_no_generated_request_gets_a_server_error(stack):
    assert SCHEMATHESIS.exists(), (
        "schemathesis is missing: python3 -m venv .venv-schemathesis && "
        ".venv-schemathesis/bin/pip install -r tests/e2e/requirements-schemathesis.txt (scripts/test-all does)"
    )
    url, key = stack["E2B_API_URL"], stack["E2B_API_KEY"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "run.json"
        done = subprocess.run(
            [
                str(SCHEMATHESIS), "run", f"{url}/openapi.yaml",
                "--checks", "not_a_server_error",
                "-H", f"X-API-Key: {key}",
                # The stateful phase follows links this description does not define.
                "--phases", "examples,coverage,fuzzing",
                "--max-time", "60", "--workers", "2", "--seed", "1",
                "--request-timeout", "20",
                "--report", "json", "--report-json-path", str(report),
            ],
            capture_output=True, text=True, timeout=300,
        )
        assert report.exists(), done.stdout + done.stderr
        run = json.loads(report.read_text())
    try:
        # "Runtime Error" is schemathesis failing in itself (seen: a CPython AST recursion
        # error inside hypothesis); anything else (a network error, a dropped connection) counts.
        assert all(e["title"] == "Runtime Error" for e in run["errors"]), done.stdout
        assert run["test_cases"]["generated"] >= 1000, done.stdout
        for failure in run["failures"]:
            assert failure["code"] == "ST101", done.stdout
            assert set(failure["operations"]) <= LEGACY_BUILDS | CREATES | RESUMES, done.stdout
        # Every server error it printed is one of those by design, by status and message.
        for status, message in re.findall(r"^\[(5\d\d)\] [^\n]*\n\n\s*`(.*)`", done.stdout, re.M):
            assert BY_DESIGN.get(status, "\0") in message, (status, message, done.stdout)
    finally:
        _kill_all(url, key)
