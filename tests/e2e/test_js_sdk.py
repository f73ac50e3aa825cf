"""The official E2B JS SDK (npm `e2b`, pinned in tests/e2e/js/package.json) against the same
local stack: create, commands, files, a terminal, a port, pause/connect, kill
(tests/e2e/js/sdk.test.mjs, run with `node --test`), and its code interpreter SDK
(npm `@e2b/code-interpreter`) against the stack's code-interpreter-v1."""

import os
import shutil
import subprocess
from pathlib import Path

JS = Path(__file__).resolve().parent / "js"


def _run_node(script, stack):
    node = shutil.which("node")
    assert node, "node is missing: install Node.js 20 (the machines have it; CI uses the same)"
    assert (JS / "node_modules" / "@e2b" / "code-interpreter").is_dir(), (
        "the JS SDKs are not installed: run `npm ci --prefix tests/e2e/js` (scripts/test-all does)"
    )
    env = dict(os.environ, **{k: v for k, v in stack.items() if k.startswith("E2B_")})
    done = subprocess.run(
        [node, "--test", "--test-reporter=spec", str(JS / script)],
        cwd=JS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_js_sdk_drives_the_stack(stack):
    _run_node("sdk.test.mjs", stack)


def test_the_js_code_interpreter_runs_code_on_the_stack(code_interpreter):
    """`@e2b/code-interpreter`'s Sandbox.create() with its default template, then runCode:
    state, results, streaming, errors, contexts, bash, timeouts (code-interpreter.test.mjs)."""
    _run_node("code-interpreter.test.mjs", code_interpreter)
