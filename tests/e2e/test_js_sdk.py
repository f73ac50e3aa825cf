"""The official E2B JS SDK (npm `e2b`, pinned in tests/e2e/js/package.json) against the same
local stack: create, commands, files, a terminal, a port, pause/connect, kill
(tests/e2e/js/sdk.test.mjs, run with `node --test`)."""

import os
import shutil
import subprocess
from pathlib import Path

JS = Path(__file__).resolve().parent / "js"


def test_the_js_sdk_drives_the_stack(stack):
    node = shutil.which("node")
    assert node, "node is missing: install Node.js 20 (the machines have it; CI uses the same)"
    assert (JS / "node_modules" / "e2b").is_dir(), (
        "the JS SDK is not installed: run `npm ci --prefix tests/e2e/js` (scripts/test-all does)"
    )
    env = dict(os.environ, **{k: v for k, v in stack.items() if k.startswith("E2B_")})
    done = subprocess.run(
        [node, "--test", "--test-reporter=spec", str(JS / "sdk.test.mjs")],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
