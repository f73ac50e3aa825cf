"""Warm pools through the E2B Python SDK: a team pools its own template (a start command that
writes when it started), and a create of it gets a sandbox whose start command ran before
the create was sent, with the create's env vars and metadata; the pool refills. Sizing a pool is this cluster's own REST route
(E2B's API has none): `PUT /templates/{templateID}/pool`."""

import os
import time
import uuid

import httpx
from conftest import OTHER_TEAM_KEY
from e2b import Sandbox, Template, wait_for_port


def _api(method, path, key=None, **kw):
    url = os.environ["E2B_API_URL"] + path
    headers = {"X-API-Key": key or os.environ["E2B_API_KEY"]}
    return httpx.request(method, url, headers=headers, timeout=30, **kw)


def _ready(template_id, n, within=120):
    deadline = time.monotonic() + within
    while True:
        pool = _api("GET", f"/templates/{template_id}/pool").json()
        if pool["ready"] == n:
            return pool
        assert time.monotonic() < deadline, f"the pool never had {n} ready: {pool}"
        time.sleep(0.2)


def test_a_create_of_a_pooled_template_gets_a_ready_sandbox(stack):
    name = f"e2e-pool-{uuid.uuid4().hex[:8]}"
    template = (
        Template()
        .from_template("base")
        .set_start_cmd("date +%s.%N > /tmp/started_at; python3 -m http.server 8000", wait_for_port(8000))
    )
    Template.build(template, name)
    template_id = _api("GET", f"/templates/aliases/{name}").json()["templateID"]

    # Another team may not size it; its own team may.
    denied = _api("PUT", f"/templates/{template_id}/pool", key=OTHER_TEAM_KEY, json={"size": 1})
    assert denied.status_code == 404, denied.text
    answer = _api("PUT", f"/templates/{name}/pool", json={"size": 1})
    assert answer.status_code == 200, answer.text
    _ready(template_id, 1)

    try:
        asked_at = time.time()
        sbx = Sandbox.create(name, envs={"POOLED_FOR": "me"}, metadata={"by": "pool-test"}, timeout=120)
        try:
            # Serving at once: its start command ran before the create.
            probe = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/').status)\""
            assert sbx.commands.run(probe).stdout == "200\n"
            assert sbx.commands.run("echo $POOLED_FOR").stdout == "me\n"
            assert sbx.get_info().metadata.get("by") == "pool-test"
            # Claimed from the pool: its start command ran before the create was sent (the
            # sandbox's clock is the host's).
            started_at = float(sbx.commands.run("cat /tmp/started_at").stdout)
            assert started_at < asked_at, (started_at, asked_at)
            _ready(template_id, 1)
        finally:
            sbx.kill()
    finally:
        _api("PUT", f"/templates/{template_id}/pool", json={"size": 0})
        _ready(template_id, 0)
