"""E2B's CLI (npm `@e2b/cli`, pinned in tests/e2e/js/package.json) against the local stack, run
as a new user runs it: E2B_API_URL and E2B_API_KEY in the environment, then `e2b sandbox list`,
`info`, `logs`, `metrics`, `kill` and `e2b template list`."""

import json
import os
import subprocess
from pathlib import Path

from e2b import Sandbox

CLI = Path(__file__).resolve().parent / "js" / "node_modules" / ".bin" / "e2b"


def e2b(stack, *args):
    assert CLI.exists(), "E2B's CLI is not installed: run `npm ci --prefix tests/e2e/js` (scripts/test-all does)"
    env = dict(os.environ, **{k: v for k, v in stack.items() if k.startswith("E2B_")})
    # No update check against the registry, no colours in what is parsed.
    env.update(NO_UPDATE_NOTIFIER="1", CI="1", NO_COLOR="1", FORCE_COLOR="0")
    done = subprocess.run([str(CLI), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"e2b {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def test_the_cli_lists_inspects_reads_logs_and_kills(stack):
    sandbox = Sandbox.create(metadata={"by": "cli-test"})
    try:
        assert sandbox.sandbox_id in e2b(stack, "sandbox", "list")
        assert sandbox.sandbox_id in e2b(stack, "sandbox", "info", sandbox.sandbox_id)

        # Every line a JSON object the CLI parses; envd's and the node's events are `system`.
        logs = e2b(stack, "sandbox", "logs", sandbox.sandbox_id, "--format", "json", "--loggers", "system")
        lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        messages = [line.get("message") for line in lines]
        assert "sandbox created" in messages, logs

        e2b(stack, "sandbox", "metrics", sandbox.sandbox_id)
        assert "base" in e2b(stack, "template", "list")

        e2b(stack, "sandbox", "kill", sandbox.sandbox_id)
        assert sandbox.sandbox_id not in e2b(stack, "sandbox", "list")
    finally:
        try:
            sandbox.kill()
        except Exception:
            pass
