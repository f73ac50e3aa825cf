#!/usr/bin/python3
"""The code interpreter's server: what E2B's `e2b-code-interpreter` SDKs speak to, on port
49999 inside a sandbox of the `code-interpreter-v1` template.

The protocol (HTTP/1.1, JSON):

- `POST /execute` `{code, context_id?, language?, env_vars?}` answers a stream of JSON lines,
  one event each, written as the kernel produces them: `stdout`/`stderr` `{text, timestamp}`
  (nanoseconds since the epoch), `number_of_executions` `{execution_count}`, `result` (a MIME
  bundle spread over `text`, `html`, `png`, ..., `extra`, with `is_main_result` set on the
  value of the cell's last expression), `error` `{name, value, traceback}`, and last
  `end_of_execution`. While code runs and says nothing, a `keepalive` line goes every few
  seconds, so proxies do not take the quiet stream for a dead one.
- `POST /contexts` `{language?, cwd?}` starts a context (one kernel or shell of its own);
  `GET /contexts` lists them; `DELETE /contexts/{id}` stops one; `POST
  /contexts/{id}/restart` starts its kernel afresh (its variables are gone).
- `POST /execute` answers 401 unless the node vouches that the caller showed the sandbox's
  access token (`X-Access-Token`, which the SDKs send there).
- `GET /health` is `OK` once the default Python kernel answers (`?wait=SECONDS` holds the
  answer until then): the template's ready command (`server.py --ready`) waits for that, so a
  sandbox is handed out with its kernel already warm.

Python runs in real Jupyter kernels (ipykernel, driven with jupyter_client over ZeroMQ), so
state, rich display, matplotlib's inline figures and tracebacks are exactly a notebook's.
Bash runs in one long-lived `bash` per context (no bash kernel is packaged by Debian): a
call's script is sourced by it, so `cd` and variables persist, and its end is found by a
random marker the shell prints with the exit status.

An execution ends early when the client goes away (the SDK's timeout closes its connection):
the kernel is interrupted, so the context is free for the next call and keeps its state. One
execution runs at a time per context; others wait their turn.

Only the standard library and what ipykernel brings (jupyter_client, tornado, pyzmq) are used:
the template installs nothing else.
"""

import asyncio
import json
import os
import queue
import shlex
import shutil
import signal
import sys
import tempfile
import time
import uuid


def until_ready(port, within_secs=30.0):
    """The template's ready command (`server.py --ready`): exits 0 once the server on `port`
    says its default kernel answers. It keeps trying while the server is not listening yet,
    then asks `/health?wait=` once, which answers the moment the kernel is up, so a create
    waits for the kernel and not for a retry's backoff. Runs before the Jupyter imports
    below: a ready command must start fast."""
    import http.client

    deadline = time.monotonic() + within_secs
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=left + 1)
        try:
            connection.request("GET", f"/health?wait={left:.1f}")
            if connection.getresponse().status == 200:
                return 0
        except OSError:
            time.sleep(0.01)
        finally:
            connection.close()
    return 1


if __name__ == "__main__" and sys.argv[1:] == ["--ready"]:
    sys.exit(until_ready(int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))))

PACKAGES = "python3-ipykernel python3-jupyter-client python3-matplotlib python3-pandas"
try:
    import tornado.httpserver
    import tornado.iostream
    import tornado.web
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
except ImportError as missing:
    sys.exit(f"the code interpreter needs Debian's {PACKAGES} on the node ({missing})")

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
# Set by the node on a request that showed the sandbox's envd access token, and removed from
# any other (the token itself never comes in): code runs only for such callers, since the
# sandbox's ID, in every host name, is no secret. The SDKs send the token on `/execute` only,
# so the context routes cannot ask for it.
ACCESS_VERIFIED = "E2b-Access-Token-Verified"
KEEPALIVE_SECS = 5.0
# How long an interrupted execution may take to stop before its kernel is restarted.
INTERRUPT_GRACE_SECS = 5.0
KERNEL_START_SECS = 60.0
# Languages SDKs may name and the kernel that runs each; the others are refused by name.
ALIASES = {"js": "javascript", "ts": "typescript", "sh": "bash", "py": "python", "python3": "python"}
RUNNABLE = ("python", "bash", "javascript")
# MIME types of a display bundle and the result field the SDKs read each from.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


# The Python kernel, started without Jupyter's kernel-spec search (which imports all of
# ipykernel into this server only to find where its spec lives: ~0.3 s) and without debugpy
# (ipykernel imports it to offer notebook debugging, which no SDK speaks: ~0.14 s of every
# kernel's start). Quiet below errors: its warnings would fill the sandbox's log.
PYTHON_KERNEL = KernelSpec(
    argv=[
        sys.executable,
        "-c",
        "import sys; sys.modules['debugpy'] = None; from ipykernel import kernelapp; kernelapp.launch_new_instance()",
        "-f",
        "{connection_file}",
        "--IPKernelApp.log_level=ERROR",
    ],
    display_name="Python 3",
    language="python",
)


# Run silently in every Python kernel once it answers: figures' displays gain `e2b/chart`
# data (charts.py, beside this file), loaded by path so nothing of this folder becomes
# importable by the user's code.
CHARTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "charts.py")
KERNEL_SETUP = f"""
def _e2b_setup():
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("e2b_charts", {CHARTS!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["e2b_charts"] = module
    module.register(get_ipython())
_e2b_setup()
del _e2b_setup
"""


class Kernels(KernelSpecManager):
    """The one kernel spec this server starts, found without a search."""

    def get_kernel_spec(self, kernel_name, *args, **kwargs):
        return PYTHON_KERNEL


class BadRequest(Exception):
    """A request the server refuses with 400 and this message."""


class NotFound(Exception):
    """A context that does not exist: 404 with this message."""


def now_ns():
    return time.time_ns()


def normalise_language(language):
    """The language an SDK named, as this server names it (`None` is Python)."""
    if language is None or language == "":
        return "python"
    if not isinstance(language, str):
        raise BadRequest("language must be a string")
    language = language.strip().lower()
    language = ALIASES.get(language, language)
    if language == "typescript":
        raise BadRequest(
            "no kernel for 'typescript' in this template: its Node.js (20) cannot strip types "
            "(Node.js does from 22.6, and no TypeScript kernel is packaged by Debian); run it "
            "as 'javascript'"
        )
    if language not in RUNNABLE:
        raise BadRequest(
            f"no kernel for {language!r} in this template: it runs {', '.join(RUNNABLE)} "
            "(no R or Java kernel is packaged by Debian, which this template is built from)"
        )
    return language


def result_event(bundle, is_main):
    """A `result` event from a Jupyter MIME bundle: known types in their fields, the rest in
    `extra` (E2B's shape)."""
    event = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            event[field] = value
    if extra:
        event["extra"] = extra
    return event


def check_env_vars(env_vars):
    if env_vars is None:
        return {}
    if not isinstance(env_vars, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
    ):
        raise BadRequest("env_vars must be an object of string values")
    for key in env_vars:
        if not key or "=" in key or "\0" in key or key[0].isdigit() or not all(c.isalnum() or c == "_" for c in key):
            raise BadRequest(f"env var name {key!r} is not a valid name")
    return env_vars


class PythonContext:
    """One ipykernel: started with the context's cwd, its messages read for one execution at a
    time (`self.turn`), and each iopub message taken only when it answers that execution."""

    language = "python"

    def __init__(self, context_id, cwd):
        self.id = context_id
        self.cwd = cwd
        self.turn = asyncio.Lock()
        self.manager = None
        self.client = None

    async def start(self):
        self.manager = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=Kernels())
        await self.manager.start_kernel(cwd=self.cwd, env=dict(os.environ))
        self.client = self.manager.client()
        self.client.start_channels()
        await self.until_answering()
        await self._run(KERNEL_SETUP, lambda event: None, silent=True)

    async def until_answering(self):
        """Until the kernel answers a `kernel_info` request on its shell channel and this
        client sees the request's status on iopub (a subscription over ZeroMQ is live only
        once a message arrives through it; output published before that would be lost).
        jupyter_client's `wait_for_ready` does the same and then drains iopub for 0.2 s more,
        which every create would wait for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KERNEL_START_SECS
        asked = set()
        while loop.time() < deadline:
            if not await self.manager.is_alive():
                raise RuntimeError("the Python kernel exited while starting")
            asked.add(self.client.kernel_info())
            try:
                await self.client.get_shell_msg(timeout=1.0)
                while True:
                    msg = await self.client.get_iopub_msg(timeout=0.05)
                    if msg["parent_header"].get("msg_id") in asked:
                        return
            except queue.Empty:
                continue
        raise TimeoutError(f"the Python kernel did not answer within {KERNEL_START_SECS:.0f} s")

    async def stop(self):
        if self.client is not None:
            self.client.stop_channels()
        if self.manager is not None:
            await self.manager.shutdown_kernel(now=True)

    async def restart(self):
        async with self.turn:
            await self.stop()
            await self.start()

    async def interrupt(self):
        await self.manager.interrupt_kernel()

    async def _run(self, code, emit, silent=False):
        """Runs `code` and hands every event it causes to `emit` until the kernel is idle."""
        msg_id = self.client.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        while True:
            try:
                msg = await self.client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if not await self.manager.is_alive():
                    # The code ended the kernel (os._exit, a crash): say so, start another.
                    await self.stop()
                    await self.start()
                    raise RuntimeError("the kernel died while running this code; it was restarted (its variables are gone)")
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return
            if silent:
                continue
            if kind == "stream":
                emit({"type": content.get("name", "stdout"), "text": content.get("text", ""), "timestamp": now_ns()})
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content.get("execution_count")})
            elif kind == "execute_result":
                emit(result_event(content.get("data", {}), True))
            elif kind in ("display_data", "update_display_data"):
                emit(result_event(content.get("data", {}), False))
            elif kind == "error":
                emit(
                    {
                        "type": "error",
                        "name": content.get("ename", ""),
                        "value": content.get("evalue", ""),
                        "traceback": "\n".join(content.get("traceback", [])),
                    }
                )

    async def execute(self, code, env_vars, emit):
        async with self.turn:
            if env_vars:
                # Set for this call only: the previous values come back after it.
                setup = (
                    "import os as _e2b_os\n"
                    f"_e2b_saved = {{k: _e2b_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                    f"_e2b_os.environ.update({env_vars!r})\n"
                )
                await self._run(setup, emit, silent=True)
            try:
                await self._run(code, emit)
            finally:
                if env_vars:
                    restore = (
                        "for _e2b_k, _e2b_v in _e2b_saved.items():\n"
                        "    _e2b_os.environ.pop(_e2b_k, None) if _e2b_v is None else _e2b_os.environ.__setitem__(_e2b_k, _e2b_v)\n"
                        "del _e2b_saved, _e2b_k, _e2b_v\n"
                    )
                    await asyncio.shield(self._run(restore, emit, silent=True))


async def end_session(process):
    """Kills a context's process and all it started (its own session), and reaps it."""
    if process is not None and process.returncode is None:
        signal_process(process, signal.SIGKILL, group=True)
        await process.wait()


def signal_process(process, number, group):
    """Sends `number` to a context's live process, or to its whole group."""
    if process is None or process.returncode is not None:
        return
    try:
        (os.killpg if group else os.kill)(process.pid, number)
    except ProcessLookupError:
        pass


class BashContext:
    """One `bash` for the context's life. A call's code is written to a file the shell
    sources; after it the shell saves its state (variables, functions, directory) and prints
    a marker with the exit status on stdout and on stderr, which is how the reader knows the
    call ended and what it returned. Code that ends the shell itself (`exit 3`) ends its call
    with that status; the next shell starts from the state saved after the previous call."""

    language = "bash"

    def __init__(self, context_id, cwd):
        self.id = context_id
        self.cwd = cwd
        self.turn = asyncio.Lock()
        self.shell = None
        self.state_dir = tempfile.mkdtemp(prefix=".e2b-bash-")
        self.state = os.path.join(self.state_dir, "state")
        self.where = os.path.join(self.state_dir, "cwd")

    async def start(self, resume=False):
        self.shell = await asyncio.create_subprocess_exec(
            "bash",
            "--noprofile",
            "--norc",
            cwd=self.cwd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # Its own process group: an interrupt reaches what it runs, not this server.
            start_new_session=True,
        )
        # An interrupt stops the command running, not the shell.
        setup = "trap true INT\n"
        if resume and os.path.exists(self.state):
            # Read-only and special variables refuse to be set again; the rest come back.
            setup += f"source {shlex.quote(self.state)} 2>/dev/null; cd \"$(cat {shlex.quote(self.where)})\" 2>/dev/null\n"
        self.shell.stdin.write(setup.encode())
        await self.shell.stdin.drain()

    async def stop(self):
        await end_session(self.shell)

    async def restart(self):
        async with self.turn:
            await self.stop()
            for path in (self.state, self.where):
                if os.path.exists(path):
                    os.remove(path)
            await self.start()

    async def interrupt(self):
        # The whole group: what the shell runs is what the interrupt is for.
        signal_process(self.shell, signal.SIGINT, group=True)

    async def _read_until(self, stream, marker, name, emit):
        """Emits what `stream` says until `marker`; returns what follows the marker up to its
        closing byte (the exit status), or `None` when the shell ended first."""
        pending = b""

        def say(text):
            if text:
                emit({"type": name, "text": text.decode("utf-8", "replace"), "timestamp": now_ns()})

        while True:
            chunk = await stream.read(65536)
            if not chunk:
                say(pending)
                return None
            pending += chunk
            at = pending.find(marker)
            if at >= 0:
                end = pending.find(b"\x1e", at + len(marker))
                while end < 0:
                    more = await stream.read(65536)
                    if not more:
                        say(pending[:at])
                        return None
                    pending += more
                    end = pending.find(b"\x1e", at + len(marker))
                say(pending[:at])
                return pending[at + len(marker) : end].decode()
            # Hold back what could be the start of the marker; say the rest now.
            keep = len(marker) - 1
            if len(pending) > keep:
                text, pending = pending[:-keep], pending[-keep:]
                say(text)

    async def execute(self, code, env_vars, emit):
        async with self.turn:
            if self.shell is None or self.shell.returncode is not None:
                await self.start(resume=True)
            token = uuid.uuid4().hex
            marker = f"\x1e{token} ".encode()
            fd, path = tempfile.mkstemp(prefix=".e2b-cell-", suffix=".sh", dir=self.state_dir)
            with os.fdopen(fd, "w") as script:
                script.write(code)
                if not code.endswith("\n"):
                    script.write("\n")
            exports = " ".join(f"export {k}={shlex.quote(v)};" for k, v in env_vars.items())
            # With per-call env vars the script runs in a subshell, so they end with it.
            run = f"( {exports} source {shlex.quote(path)} )" if env_vars else f"source {shlex.quote(path)}"
            save = f"{{ declare -p; declare -f; }} >{shlex.quote(self.state)} 2>/dev/null; pwd >{shlex.quote(self.where)}"
            line = (
                f"{run} </dev/null; __e2b_status=$?; rm -f {shlex.quote(path)}; {save}; "
                f"printf '\\036%s %s\\036' {token} $__e2b_status; printf '\\036%s %s\\036' {token} $__e2b_status >&2\n"
            )
            self.shell.stdin.write(line.encode())
            await self.shell.stdin.drain()
            status, _ = await asyncio.gather(
                self._read_until(self.shell.stdout, marker, "stdout", emit),
                self._read_until(self.shell.stderr, marker, "stderr", emit),
            )
            if status is None:
                # The code ended the shell (`exit`): its status is the call's.
                os.path.exists(path) and os.remove(path)
                status = str(await self.shell.wait())
            if status.strip() not in ("", "0"):
                emit({"type": "error", "name": "ExitCode", "value": f"exit status {status.strip()}", "traceback": ""})


class JavaScriptContext:
    """One Node.js process for the context's life, running `javascript.js` beside this file:
    a cell is a JSON line to its stdin; its events come back on its stdout as lines that
    start with a token of this context (anything else there is output of a process the cell
    started), and `done` ends the cell. A process that exits (the cell called
    `process.exit`) ends its cell with an error; the next cell starts a fresh one."""

    language = "javascript"
    DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "javascript.js")

    def __init__(self, context_id, cwd):
        self.id = context_id
        self.cwd = cwd
        self.turn = asyncio.Lock()
        self.node = None
        self.token = ""

    async def start(self):
        node = shutil.which("node")
        if node is None:
            raise BadRequest("javascript needs Node.js (`node`) in the sandbox, and this template has none")
        self.token = f"\x1e{uuid.uuid4().hex}\x1f"
        self.node = await asyncio.create_subprocess_exec(
            node,
            self.DRIVER,
            cwd=self.cwd,
            env=dict(os.environ, E2B_JS_EVENTS_TOKEN=self.token),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            # A cell's output can be one long line.
            limit=64 << 20,
        )

    async def stop(self):
        await end_session(self.node)

    async def restart(self):
        async with self.turn:
            await self.stop()
            await self.start()

    async def interrupt(self):
        # Node alone: its SIGINT handler interrupts the cell, and the cell's children go on.
        signal_process(self.node, signal.SIGINT, group=False)

    async def _events(self, cell, emit):
        """Emits the cell's events until its `done`; False when the process ended first."""
        token = self.token.encode()
        while True:
            line = await self.node.stdout.readline()
            if not line:
                return False
            if not line.startswith(token):
                emit({"type": "stdout", "text": line.decode("utf-8", "replace"), "timestamp": now_ns()})
                continue
            event = json.loads(line[len(token) :])
            if event.get("type") == "done":
                if event.get("id") == cell:
                    return True
                continue
            if event["type"] in ("stdout", "stderr"):
                event["timestamp"] = now_ns()
            emit(event)

    async def _stderr(self, emit):
        """What the process itself writes to stderr (Node's own warnings, a child's output)."""
        while True:
            chunk = await self.node.stderr.read(65536)
            if not chunk:
                return
            emit({"type": "stderr", "text": chunk.decode("utf-8", "replace"), "timestamp": now_ns()})

    async def execute(self, code, env_vars, emit):
        async with self.turn:
            if self.node is None or self.node.returncode is not None:
                await self.start()
            cell = uuid.uuid4().hex
            self.node.stdin.write((json.dumps({"id": cell, "code": code, "env": env_vars}) + "\n").encode())
            await self.node.stdin.drain()
            errors = asyncio.ensure_future(self._stderr(emit))
            try:
                finished = await self._events(cell, emit)
            finally:
                errors.cancel()
            if not finished:
                status = await self.node.wait()
                emit({"type": "error", "name": "ExitCode", "value": f"the JavaScript context exited with status {status}", "traceback": ""})


class Contexts:
    """Every context of this sandbox, and which one is each language's default."""

    def __init__(self):
        self.by_id = {}
        self.defaults = {}
        self.ready = asyncio.Event()

    async def create(self, language, cwd):
        language = normalise_language(language)
        cwd = cwd or DEFAULT_CWD
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest(f"cwd {cwd!r} is not a directory in the sandbox")
        kind = {"python": PythonContext, "bash": BashContext, "javascript": JavaScriptContext}[language]
        context = kind(str(uuid.uuid4()), cwd)
        await context.start()
        self.by_id[context.id] = context
        return context

    async def default(self, language):
        language = normalise_language(language)
        context = self.by_id.get(self.defaults.get(language))
        if context is None:
            context = await self.create(language, DEFAULT_CWD)
            self.defaults[language] = context.id
        return context

    def get(self, context_id):
        if not isinstance(context_id, str) or context_id not in self.by_id:
            raise NotFound(f"context {context_id!r} not found")
        return self.by_id[context_id]

    async def remove(self, context_id):
        context = self.get(context_id)
        del self.by_id[context_id]
        for language, default in list(self.defaults.items()):
            if default == context_id:
                del self.defaults[language]
        await context.stop()


def describe(context):
    return {"id": context.id, "language": context.language, "cwd": context.cwd}


class Handler(tornado.web.RequestHandler):
    def initialize(self, contexts):
        self.contexts = contexts

    def body(self):
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError as err:
            raise BadRequest(f"the body is not JSON: {err}") from err
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def refuse(self, status, message):
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(message)

    async def guarded(self, work):
        try:
            await work()
        except BadRequest as err:
            self.refuse(400, str(err))
        except NotFound as err:
            self.refuse(404, str(err))

    def write_json(self, value, status=200):
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(value))


class Health(Handler):
    async def get(self):
        # `?wait=SECONDS` holds the answer until the kernel is up (at most that long): the
        # template's ready command asks once and is answered the moment it is.
        try:
            wait = min(float(self.get_query_argument("wait", "0")), KERNEL_START_SECS)
        except ValueError:
            return self.refuse(400, "wait must be a number of seconds")
        if wait > 0 and not self.contexts.ready.is_set():
            try:
                await asyncio.wait_for(self.contexts.ready.wait(), wait)
            except asyncio.TimeoutError:
                pass
        if self.contexts.ready.is_set():
            self.finish("OK")
        else:
            self.refuse(503, "the default Python kernel is starting")


class ContextList(Handler):
    async def get(self):
        self.write_json([describe(c) for c in self.contexts.by_id.values()])

    async def post(self):
        async def work():
            body = self.body()
            context = await self.contexts.create(body.get("language"), body.get("cwd"))
            self.write_json(describe(context))

        await self.guarded(work)


class OneContext(Handler):
    async def delete(self, context_id):
        async def work():
            await self.contexts.remove(context_id)
            self.set_status(204)
            self.finish()

        await self.guarded(work)


class Restart(Handler):
    async def post(self, context_id):
        async def work():
            await self.contexts.get(context_id).restart()
            self.set_status(204)
            self.finish()

        await self.guarded(work)


class Execute(Handler):
    """`POST /execute`: events go to a queue as the kernel makes them, and from it to the
    client; a closed connection interrupts the execution."""

    gone = None

    def on_connection_close(self):
        if self.gone is not None:
            self.gone.set()

    async def post(self):
        self.gone = asyncio.Event()
        if self.request.headers.get(ACCESS_VERIFIED) != "true":
            return self.refuse(401, "the sandbox's access token is required in X-Access-Token")
        await self.guarded(self.execute)

    async def execute(self):
        body = self.body()
        code = body.get("code")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        if body.get("context_id") and body.get("language"):
            raise BadRequest("give context_id or language, not both")
        env_vars = check_env_vars(body.get("env_vars"))
        if body.get("context_id"):
            context = self.contexts.get(body["context_id"])
        else:
            context = await self.contexts.default(body.get("language"))
        events = asyncio.Queue()
        running = asyncio.ensure_future(context.execute(code, env_vars, events.put_nowait))
        running.add_done_callback(lambda _: events.put_nowait(None))
        self.set_header("Content-Type", "application/x-ndjson")
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            while True:
                next_event = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({next_event, gone}, timeout=KEEPALIVE_SECS, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    next_event.cancel()
                    await self.stop_early(context, running)
                    return
                if not done:
                    next_event.cancel()
                    self.write('{"type": "keepalive"}\n')
                    await self.flush()
                    continue
                event = next_event.result()
                if event is None:
                    break
                self.write(json.dumps(event) + "\n")
                await self.flush()
            failure = running.exception()
            if failure is not None:
                self.write(json.dumps({"type": "error", "name": type(failure).__name__, "value": str(failure), "traceback": ""}) + "\n")
            self.write('{"type": "end_of_execution"}\n')
            self.finish()
        except tornado.iostream.StreamClosedError:
            await self.stop_early(context, running)
        finally:
            gone.cancel()

    async def stop_early(self, context, running):
        """The client left: interrupt, and restart the kernel if it will not stop."""
        if running.done():
            return
        await context.interrupt()
        try:
            await asyncio.wait_for(asyncio.shield(running), INTERRUPT_GRACE_SECS)
        except Exception:
            running.cancel()
            await context.stop()
            await context.start()


def prepare_environment():
    """What the kernels inherit. Debian's matplotlib finds its matplotlibrc in /etc, which is
    the template's own and does not have it: point at the copy in /usr."""
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    packaged = "/usr/share/matplotlib/mpl-data/matplotlibrc"
    if not os.path.exists("/etc/matplotlibrc") and os.path.exists(packaged):
        os.environ.setdefault("MATPLOTLIBRC", packaged)


def warm():
    """Run once by the template's build, as the sandbox's user: pays now, in the layer every
    sandbox starts from, what a first cell would pay (matplotlib's font cache, IPython's
    profile), and fails the build with what to install when the node lacks a package."""
    prepare_environment()
    try:
        import IPython.paths
        import ipykernel  # noqa: F401
        import matplotlib.pyplot  # noqa: F401
        import pandas  # noqa: F401
        from IPython.core.profiledir import ProfileDir
    except ImportError as missing:
        sys.exit(f"the code interpreter needs Debian's {PACKAGES} on the node ({missing})")
    ProfileDir.create_profile_dir_by_name(IPython.paths.get_ipython_dir(), "default")
    print("code interpreter: packages present, caches warm")


def main():
    if sys.argv[1:] == ["--warm"]:
        warm()
        return
    # What this server starts inherits its dispositions: a server started in the background
    # by a shell has SIGINT ignored, and a shell started ignoring it cannot trap it, so an
    # interrupt would never reach a bash context's commands.
    for number in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    prepare_environment()
    contexts = Contexts()
    app = tornado.web.Application(
        [
            (r"/health", Health, {"contexts": contexts}),
            (r"/contexts", ContextList, {"contexts": contexts}),
            (r"/contexts/([^/]+)", OneContext, {"contexts": contexts}),
            (r"/contexts/([^/]+)/restart", Restart, {"contexts": contexts}),
            (r"/execute", Execute, {"contexts": contexts}),
        ],
        log_function=lambda handler: None,
    )

    async def serve():
        server = tornado.httpserver.HTTPServer(app, idle_connection_timeout=3600)
        server.listen(PORT)
        await contexts.default("python")
        contexts.ready.set()
        print(f"code interpreter serving on :{PORT}", file=sys.stderr, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
