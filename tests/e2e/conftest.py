"""Starts the whole local stack (`sandboxsched up`, embedded default) on free ports for the
end-to-end suite, and points the E2B SDK at it through its documented environment variables
only: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER_TEAM_KEY = "e2b_other_team_key"


def _binary(name: str = "sandboxsched") -> Path:
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / name
        if path.exists():
            return path
    raise RuntimeError(f"target/debug/{name} is missing: run `cargo build` (scripts/test-all does)")


def _static_envd() -> dict:
    """The static envd (scripts/build-static-envd), which templates built from images need."""
    for profile in ("debug", "release"):
        path = ROOT / "target" / "x86_64-unknown-linux-gnu" / profile / "sandboxsched-envd"
        if path.exists():
            return {"SANDBOXSCHED_ENVD_BINARY": str(path)}
    return {}


def _start(nodes: int, log_level: str, **extra):
    """Runs `sandboxsched up` on free ports; returns (process, data dir, log path, exports)."""
    data = Path(tempfile.mkdtemp(prefix="e2e-stack-"))
    env = dict(os.environ)
    env.update(
        SANDBOXSCHED_DATA_DIR=str(data),
        SANDBOXSCHED_LEDGER_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_PLACEMENT_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_BALANCE_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_GATEWAY_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_CONSOLE_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_NODE_BASE_PORT="0",
        SANDBOXSCHED_METRICS_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_NODES=str(nodes),
        # A second team, for the tests that attack one team's sandbox from another.
        SANDBOXSCHED_API_KEYS=f"{OTHER_TEAM_KEY}=other-team",
        RUST_LOG=log_level,
        # The template tests' registry, on loopback: builds may pull from it only when allowed.
        # (and 127.0.0.1:5059, where nothing listens: the unreachable-registry test).
        SANDBOXSCHED_PRIVATE_REGISTRIES=os.environ.get("BLOBS_TEST_REGISTRY", "127.0.0.1:5056") + ",127.0.0.1:5059",
        **_static_envd(),
        **extra,
    )
    # Output goes to a file, never a pipe nobody drains: a full pipe would stall the stack.
    log = data / "stack.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(_binary()), "up"], env=env, stdout=out, stderr=subprocess.STDOUT)
    exports = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text()
        exports = dict(re.findall(r"export (E2B_[A-Z_]+)=(\S+)", text))
        if "Press Ctrl-C" in text:
            break
        time.sleep(0.05)
    if set(exports) != {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"}:
        proc.kill()
        raise RuntimeError("the stack did not come up:\n" + log.read_text())
    return proc, data, log, exports


def _stop(proc, data):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(scope="session")
def stack():
    proc, data, _log, exports = _start(2, "warn")
    os.environ.update(exports)
    # The stack's process (gateway and nodes in one), for tests that measure its memory, and
    # its data directory, where its sandboxes' files are, for tests that need room there.
    console = re.search(r"console-svc\s+http (\S+)", _log.read_text()).group(1)
    admin_token = (data / "admin_token").read_text().strip()
    yield {**exports, "pid": proc.pid, "state": str(data), "log": str(_log), "console": console,
           "admin_token": admin_token}
    _stop(proc, data)


@pytest.fixture(scope="session")
def code_interpreter(stack):
    """The stack's `code-interpreter-v1`, which `up` builds once a node is there: waits for
    the line `up` prints when it is ready (a build takes seconds), and fails with the log when
    it does not come."""
    log = Path(stack["log"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = log.read_text()
        if "code-interpreter-v1: ready" in text:
            return stack
        time.sleep(0.2)
    raise RuntimeError("code-interpreter-v1 was not ready within 300 s:\n" + log.read_text()[-5000:])


@pytest.fixture(scope="module")
def balanced_stack():
    """Three small nodes (2 GiB each, so a few hundred MB of real use is a clear skew, and four
    sandboxes of 512 MiB fit one node: placement, which counts what sandboxes ask for, leaves
    room on every node for a moved one) with balance-svc observing every second; its log is
    where observations and plans show."""
    proc, data, log, exports = _start(
        3,
        "info",
        SANDBOXSCHED_NODE_MEMORY_MB="2048",
        SANDBOXSCHED_BALANCE_INTERVAL_MS="1000",
        # Not this stack's subject (the session stack builds it).
        SANDBOXSCHED_NO_CODE_INTERPRETER="true",
    )
    saved = {k: os.environ.get(k) for k in exports}
    os.environ.update(exports)
    balance = re.search(r"balance-svc\s+grpc (\S+)", log.read_text()).group(1)
    ledger = re.search(r"ledger-svc\s+grpc (\S+)", log.read_text()).group(1)
    # sandboxsched-ctl proves the operator's role with the stack's certificates.
    yield {"exports": exports, "log": log, "ctl": _binary("sandboxsched-ctl"), "balance": balance, "ledger": ledger,
           "certs": str(data / "certs")}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _stop(proc, data)
