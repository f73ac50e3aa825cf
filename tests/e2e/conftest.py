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


def _binary() -> Path:
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / "sandboxsched"
        if path.exists():
            return path
    raise RuntimeError("target/debug/sandboxsched is missing: run `cargo build` (scripts/test-all does)")


@pytest.fixture(scope="session")
def stack():
    data = Path(tempfile.mkdtemp(prefix="e2e-stack-"))
    env = dict(os.environ)
    env.update(
        SANDBOXSCHED_DATA_DIR=str(data),
        SANDBOXSCHED_LEDGER_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_PLACEMENT_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_GATEWAY_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_NODE_BASE_PORT="0",
        SANDBOXSCHED_METRICS_LISTEN="127.0.0.1:0",
        SANDBOXSCHED_NODES="2",
        RUST_LOG="warn",
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
    os.environ.update(exports)
    yield exports
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(data, ignore_errors=True)
