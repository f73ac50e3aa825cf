"""compose.yaml started for real (with compose.ci.yaml, whose images need no registry:
scripts/compose-images builds them), then the E2B Python SDK through the published gateway
port: create, a command, files, pause and connect, a sandbox's port, a drain that moves a
sandbox between the two node containers, a node container killed and started again with its
sandbox taken back, the services' traces arriving at an OTLP receiver (the `jaeger` service of
the override: `sandboxsched trace-sink`), and `down -v` leaving nothing behind.

Run by scripts/test-compose (after scripts/compose-images)."""

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "sandboxsched-ci"
COMPOSE = ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.ci.yaml")]
URL = "http://127.0.0.1:3000"
KEY = "e2b_compose_test_key"


def compose(*args, check=True, timeout=300):
    # compose.yaml refuses to start without the operator's own key.
    env = {**os.environ, "E2B_API_KEY": KEY}
    done = subprocess.run([*COMPOSE, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def ctl(*args):
    """sandboxsched-ctl in the operator's container (the one that holds the operator's pair),
    against the services' own addresses."""
    out = compose("exec", "-T", "operator", "sandboxsched-ctl", "--json", *args)
    return json.loads(out) if out.strip().startswith(("{", "[")) else out


def eventually(what, check, within=120):
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def every_health_check_passes():
    """Every container with a health check reports healthy (a wrong port or command in one
    of compose.yaml's checks keeps it "starting", then "unhealthy")."""
    ids = compose("ps", "-q").split()
    if not ids:
        return False
    states = subprocess.run(
        ["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}", *ids],
        capture_output=True, text=True,
    ).stdout.split()
    return len(states) == len(ids) and all(s in ("healthy", "none") for s in states)


def healthy():
    try:
        return httpx.get(f"{URL}/health", timeout=2).status_code == 204
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack():
    compose("down", "-v", "--remove-orphans", check=False)
    try:
        compose("up", "-d", "--no-build", timeout=600)
        eventually("the gateway through its published port", healthy, within=180)
        eventually("every container's health check", every_health_check_passes, within=120)
        os.environ.update(E2B_API_URL=URL, E2B_SANDBOX_URL=URL, E2B_API_KEY=KEY)
        yield
    except BaseException:
        print(compose("logs", "--tail", "60", check=False))
        raise
    finally:
        compose("down", "-v", "--remove-orphans", check=False, timeout=300)
        left = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
            capture_output=True, text=True,
        ).stdout.split()
        assert left == [], f"down -v left containers: {left}"
        volumes = subprocess.run(
            ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"],
            capture_output=True, text=True,
        ).stdout.split()
        assert volumes == [], f"down -v left volumes: {volumes}"


def test_each_container_holds_its_own_key_alone(stack):
    """A broken-into container holds its own pair and the CA's certificate, never another
    role's key or the CA's."""
    expected = {
        "ledger": {"ca.pem", "ledger.pem", "ledger.key"},
        "placement": {"ca.pem", "placement.pem", "placement.key"},
        "balance": {"ca.pem", "balance.pem", "balance.key"},
        "gateway": {"ca.pem", "gateway.pem", "gateway.key", "tokens.key", "admin_token"},
        "console": {"ca.pem", "console.pem", "console.key", "admin_token"},
        "node-1": {"ca.pem", "node-node-1.pem", "node-node-1.key"},
        "node-2": {"ca.pem", "node-node-2.pem", "node-node-2.key"},
        "operator": {"ca.pem", "operator.pem", "operator.key"},
    }
    for service, files in expected.items():
        held = set(compose("exec", "-T", service, "ls", "-A", "/certs").split())
        assert held == files, f"{service} holds {sorted(held)}"


def test_only_the_ledger_and_placement_reach_the_stores(stack):
    """A broken-into node or gateway (the containers tenants' code and traffic come closest
    to) cannot write the ledger's tables or placement's view behind those services' checks:
    Redis and PostgreSQL sit on a network only the ledger and placement join."""

    def reaches(service, host, port):
        probe = f"</dev/tcp/{host}/{port}"
        done = subprocess.run([*COMPOSE, "exec", "-T", service, "timeout", "5", "bash", "-c", probe],
                              capture_output=True, text=True, timeout=60)
        return done.returncode == 0

    assert reaches("ledger", "postgres", 5432), "the ledger lost its database"
    assert reaches("placement", "redis", 6379), "placement lost its Redis"
    for service in ("node-1", "node-2", "gateway", "balance", "operator", "console"):
        for host, port in (("postgres", 5432), ("redis", 6379)):
            assert not reaches(service, host, port), f"{service} reaches {host}:{port}"


CONSOLE = "http://127.0.0.1:3001/console"
PROMETHEUS = "http://127.0.0.1:9090"


def test_the_console_answers_operators_alone(stack):
    """The console on the host's loopback: the admin token the certs job made opens it and it
    shows both node containers; the tenants' API key does not."""
    token = compose("exec", "-T", "console", "cat", "/certs/admin_token").strip()
    assert token.startswith("admin_") and len(token) > 40, "the admin token is not a random one"
    cluster = eventually("both nodes on the console", lambda: (
        r := httpx.get(f"{CONSOLE}/api/cluster", headers={"X-Admin-Token": token}, timeout=5)
    ).status_code == 200 and len(r.json()["nodes"]) == 2 and r.json())
    assert {n["nodeId"] for n in cluster["nodes"]} == {"node-1", "node-2"}
    refused = httpx.get(f"{CONSOLE}/api/cluster", headers={"X-Admin-Token": KEY}, timeout=5)
    assert refused.status_code == 401, refused.text
    # The gateway's admin routes take the same token.
    nodes = httpx.get(f"{URL}/nodes", headers={"X-Admin-Token": token}, timeout=5)
    assert nodes.status_code == 200 and len(nodes.json()) == 2, nodes.text


def test_prometheus_scrapes_every_service_and_the_dashboard_queries_run(stack):
    """Prometheus loaded the alert rules of deploy/, scrapes every service up, and every
    query of the Grafana dashboard runs on it (a misspelt metric or label is an error or no
    data in Grafana; here, an empty answer for the metrics every service exports at start)."""
    rules = eventually("the alert rules loaded", lambda: httpx.get(f"{PROMETHEUS}/api/v1/rules", timeout=5).json()
                       ["data"]["groups"])
    names = {r["name"] for g in rules for r in g["rules"]}
    assert {"SandboxschedNodeHeartbeatStale", "SandboxschedPlacementRefusing", "SandboxschedDnsShed"} <= names, names

    def all_up():
        targets = httpx.get(f"{PROMETHEUS}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return len(targets) == 7 and all(t["health"] == "up" for t in targets) and targets

    eventually("every service scraped", all_up, within=60)
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/sandboxsched.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) > 20
    for query in queries:
        answer = httpx.post(f"{PROMETHEUS}/api/v1/query", timeout=10,
                            data={"query": query.replace("$__rate_interval", "1m")}).json()
        assert answer["status"] == "success", (query, answer)
    # What every node reports from its first heartbeat on: each node's memory, per node.
    memory = eventually("node memory in Prometheus", lambda: httpx.post(
        f"{PROMETHEUS}/api/v1/query", timeout=10,
        data={"query": 'placement_node_memory_bytes{kind="capacity"}'}).json()["data"]["result"])
    assert {m["metric"]["node"]: int(float(m["value"][1])) >> 20 for m in memory} == {"node-1": 4096, "node-2": 8192}


def node_of(sandbox_id):
    return next(s for s in ctl("sandboxes") if s["sandbox"] == sandbox_id)["node"]


def test_the_sdk_through_compose(stack):
    sbx = Sandbox.create(timeout=600)
    try:
        assert sbx.commands.run("echo hi from $(hostname)").stdout.strip() == f"hi from {sbx.sandbox_id}"
        assert sbx.commands.run("id -u", user="root").stdout.strip() == "0"
        # A disk of its own (the gateway's default, 2 GiB), not the node container's.
        size_kb = int(sbx.commands.run("df -k / | tail -1 | awk '{print $2}'").stdout)
        assert 1024 * 1024 < size_kb <= 2 * 1024 * 1024, size_kb
        sbx.files.write("/tmp/notes.txt", "kept across moves")
        assert sbx.files.read("/tmp/notes.txt") == "kept across moves"

        sbx.beta_pause()
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert sbx.files.read("/tmp/notes.txt") == "kept across moves"

        # A port of the sandbox, by the gateway's routing headers.
        sbx.files.write("/home/user/index.html", "served")
        sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        sbx.commands.run(
            "for i in $(seq 100); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\" "
            "2>/dev/null && exit 0; sleep 0.05; done; exit 1"
        )
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
        r = httpx.get(f"{URL}/index.html", headers=headers, timeout=10)
        assert (r.status_code, r.text) == (200, "served")

        # A drain moves it to the other node container, files and all.
        source = node_of(sbx.sandbox_id)
        ctl("drain", source)
        target = eventually("the sandbox to move", lambda: (n := node_of(sbx.sandbox_id)) != source and n)
        ctl("drain", source, "--undo")
        assert target in ("node-1", "node-2") and target != source
        assert sbx.files.read("/tmp/notes.txt") == "kept across moves"

        # Its node container killed and started again: the sandbox is taken back (its
        # processes died with the container; its files and identity did not).
        compose("kill", target)
        compose("start", target)
        eventually(
            "the sandbox to answer again",
            lambda: _answers(sbx),
            within=120,
        )
        assert sbx.files.read("/tmp/notes.txt") == "kept across moves"
    finally:
        sbx.kill()
    # The create's spans, from the gateway and a node, reached the receiver.
    eventually(
        "the services' traces at the OTLP receiver",
        lambda: all(
            line in compose("logs", "--no-color", "jaeger")
            for line in ("service=e2b-gateway name=POST /sandboxes", "service=node-svc")
        ),
        within=60,
    )


def _answers(sbx):
    try:
        return sbx.commands.run("true", timeout=5).exit_code == 0
    except Exception:  # noqa: BLE001 - any failure means "not yet"
        return False
