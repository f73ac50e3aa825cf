"""The real client: the E2B Python SDK from PyPI against the local stack, with nothing but
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set."""

import time

import httpx
import pytest
from conftest import OTHER_TEAM_KEY
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
)


def test_a_sandbox_through_its_whole_life(stack):
    sbx = Sandbox.create(metadata={"suite": "e2e", "run": "life"}, envs={"GREETING": "hello"}, timeout=120)
    try:
        # Commands: output, exit codes, env vars, working directory, background.
        r = sbx.commands.run("echo $GREETING from $PWD")
        assert (r.stdout, r.exit_code) == ("hello from /home/user\n", 0)
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo nope >&2; exit 3")
        assert failed.value.exit_code == 3
        assert "nope" in failed.value.stderr
        assert sbx.commands.run("echo $ONLY_HERE", envs={"ONLY_HERE": "per-command"}).stdout == "per-command\n"
        sbx.files.make_dir("work")
        assert sbx.commands.run("pwd", cwd="/home/user/work").stdout == "/home/user/work\n"
        assert sbx.commands.run("ls /home/user").stdout == "work\n"
        background = sbx.commands.run("sleep 60", background=True)
        assert background.pid in [p.pid for p in sbx.commands.list()]
        background.kill()

        # A directory watch sees a new file.
        watch = sbx.files.watch_dir("work")
        sbx.files.write("work/seen.txt", "hi")
        deadline = time.monotonic() + 10
        names = set()
        while "seen.txt" not in names and time.monotonic() < deadline:
            names |= {event.name for event in watch.get_new_events()}
            time.sleep(0.05)
        watch.stop()
        assert "seen.txt" in names
        sbx.files.remove("work/seen.txt")

        # Files: write, read, list.
        sbx.files.write("work/notes.txt", "kept across pause")
        assert sbx.files.read("work/notes.txt") == "kept across pause"
        assert [e.name for e in sbx.files.list("work")] == ["notes.txt"]

        # Pause, then connect: resumed, files there, commands run.
        sbx.pause()
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.state.value == "paused"
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.files.read("work/notes.txt") == "kept across pause"
        assert again.commands.run("cat work/notes.txt").stdout == "kept across pause"

        # Timeout, and list with a metadata filter.
        again.set_timeout(300)
        found = Sandbox.list(query=SandboxQuery(metadata={"run": "life"})).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        assert found[0].metadata == {"suite": "e2e", "run": "life"}
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"})).next_items() == []
    finally:
        sbx.kill()
    assert sbx.is_running() is False


def test_a_sandbox_is_a_container_of_its_own(stack):
    """What E2B users do every day works (files anywhere, root when asked), and what untrusted
    code must not reach stays out of reach: the host's files and every port of the host."""
    sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.commands.run("id -u").stdout == "1000\n"
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        sbx.files.write("/tmp/scratch.txt", "anywhere")
        sbx.files.write("/opt/app/config.json", "{}", user="root")
        assert sbx.files.read("/tmp/scratch.txt") == "anywhere"
        assert sbx.commands.run("cat /opt/app/config.json").stdout == "{}"
        assert sbx.commands.run("hostname").stdout.strip() == sbx.sandbox_id
        # The host's filesystem is not the sandbox's.
        with pytest.raises(CommandExitException):
            sbx.commands.run("ls /work || cat /etc/shadow", user="root")
        # The gateway this test talks to listens on the host's loopback: not from inside.
        port = httpx.URL(stack["E2B_API_URL"]).port
        probe = (f"python3 -c \"import socket; s = socket.socket(); s.settimeout(2); "
                 f"s.connect(('127.0.0.1', {port})); print('reached')\"")
        with pytest.raises(CommandExitException) as refused:
            sbx.commands.run(probe)
        assert "reached" not in refused.value.stdout
    finally:
        sbx.kill()
    # Egress: a link out by default (the host is its gateway and still out of reach, above);
    # none at all without internet access; what this cluster cannot filter (domain names) is
    # refused up front, never silently dropped.
    sealed = Sandbox.create(allow_internet_access=False, timeout=30)
    try:
        assert sealed.commands.run("ls /sys/class/net").stdout.split() == ["lo"]
    finally:
        sealed.kill()
    with pytest.raises(SandboxException) as refused:
        Sandbox.create(network={"allow_out": ["example.com"]}, timeout=30)
    assert "domain" in str(refused.value)


def test_a_sandboxs_port_through_the_gateway(stack):
    """get_host(port): a web server in the sandbox answers through the gateway, addressed
    by host name; a sandbox made with allow_public_traffic=False answers only with its traffic
    token; nothing listening is a 502."""
    sbx = Sandbox.create(timeout=120)
    private = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        url = stack["E2B_SANDBOX_URL"]
        for box in (sbx, private):
            box.files.write("/home/user/index.html", f"hello from {box.sandbox_id}")
            box.commands.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        # The server binds a moment after the command starts: wait for it from inside.
        for box in (sbx, private):
            box.commands.run(
                "for i in $(seq 100); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\" "
                "2>/dev/null && exit 0; sleep 0.05; done; exit 1"
            )
        r = httpx.get(url + "/index.html", headers={"Host": sbx.get_host(8000)})
        assert (r.status_code, r.text) == (200, f"hello from {sbx.sandbox_id}")
        missing = httpx.get(url + "/", headers={"Host": sbx.get_host(9)})
        assert missing.status_code == 502 and missing.json()["code"] == 502
        token = private.traffic_access_token
        assert token
        host = {"Host": private.get_host(8000)}
        assert httpx.get(url + "/index.html", headers=host).status_code == 401
        r = httpx.get(url + "/index.html", headers={**host, "e2b-traffic-access-token": token})
        assert (r.status_code, r.text) == (200, f"hello from {private.sandbox_id}")
        # Another sandbox's traffic token is not this one's.
        assert sbx.traffic_access_token is None
    finally:
        sbx.kill()
        private.kill()


COOKIE_SERVER = r"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        host = self.headers.get("Host", "")
        self.send_header("Set-Cookie", "tossed=1; Domain=%s; Path=/" % host.partition(".")[2])
        self.send_header("Set-Cookie", "own=1; Path=/; HttpOnly")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8001), H).serve_forever()
"""


def test_a_sandboxs_port_cannot_reach_other_tenants_or_the_platforms_credentials(stack):
    """Every sandbox's ports share one domain: a tenant's server setting a cookie for that
    whole domain (to plant it on every other tenant's host) has it kept to its own host; the
    operators' admin token a caller sends never reaches the sandbox (a header of the tenant's
    own, such as X-API-Key, does)."""
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/server.py", COOKIE_SERVER)
        sbx.commands.run("python3 /home/user/server.py", background=True)
        sbx.commands.run(
            "for i in $(seq 100); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8001))\" "
            "2>/dev/null && exit 0; sleep 0.05; done; exit 1"
        )
        r = httpx.get(
            stack["E2B_SANDBOX_URL"] + "/",
            headers={"Host": sbx.get_host(8001), "X-Admin-Token": "operators-secret", "X-API-Key": "app-key"},
        )
        assert r.status_code == 200, r.text
        cookies = r.headers.get_list("set-cookie")
        assert cookies == ["tossed=1; Path=/", "own=1; Path=/; HttpOnly"], cookies
        seen = r.json()
        assert "x-admin-token" not in seen, seen
        assert seen.get("x-api-key") == "app-key", seen
    finally:
        sbx.kill()


def test_the_sdk_error_paths(stack):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_not_a_key")
    with pytest.raises(NotFoundException):
        Sandbox.connect("i-does-not-exist")
    with pytest.raises((NotFoundException, SandboxException)) as unknown:
        Sandbox.create("no-such-template")
    assert "no-such-template" in str(unknown.value)


def test_a_sandbox_ends_at_its_timeout(stack):
    sbx = Sandbox.create(timeout=1)
    deadline = time.monotonic() + 20
    while sbx.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sbx.is_running() is False


def test_a_terminal(stack):
    """sandbox.pty: an interactive login shell on a pseudo-terminal, its size, a resize, and
    typed input; the output is what a terminal would show."""
    sbx = Sandbox.create(timeout=60)
    try:
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        output = iter(term)
        seen = bytearray()

        def until(marker: bytes):
            # The shell echoes what is typed, so markers are computed by it ($((…))).
            deadline = time.monotonic() + 20
            while marker not in seen:
                assert time.monotonic() < deadline, f"no {marker!r} in {bytes(seen)!r}"
                _, _, chunk = next(output)
                if chunk is not None:
                    seen.extend(chunk)

        sbx.pty.send_stdin(term.pid, b"stty size; tty; echo pty-$((40+2))\n")
        until(b"pty-42")
        assert b"24 80" in seen
        assert b"/dev/pts/" in seen, "the shell's stdin is a terminal"
        sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size; echo pty-$((50+2))\n")
        until(b"pty-52")
        assert b"30 100" in seen
        sbx.pty.send_stdin(term.pid, b"exit 0\n")
        assert term.wait().exit_code == 0
    finally:
        sbx.kill()


def test_input_streamed_to_a_command_and_a_terminal(stack):
    """commands.stream_input / pty.stream_input (process.Process/StreamInput, client
    streaming), beside send_stdin and close_stdin."""
    sbx = Sandbox.create(timeout=60)
    try:
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "one\n")
        sbx.commands.stream_input(cat.pid, ["two\n", b"three\n"])
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "one\ntwo\nthree\n"

        # The job left running keeps the terminal open; the session still ends with the shell.
        term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=30)
        sbx.pty.stream_input(term.pid, [b"sleep 300 &\n", b"echo streamed-$((6*7))\n", b"exit 3\n"])
        seen = bytearray()
        started = time.monotonic()
        with pytest.raises(CommandExitException) as ended:
            term.wait(on_pty=seen.extend)
        assert time.monotonic() - started < 10
        assert ended.value.exit_code == 3
        assert b"streamed-42" in seen
    finally:
        sbx.kill()


def test_envd_answers_only_the_sandboxs_access_token(stack):
    """From the attacker's side: knowing a sandbox's ID, holding another team's API key, the
    owner's API key, or another sandbox's token opens none of its envd routes; the SDK's signed
    file URLs work with no headers at all, addressed by the sandbox's host name."""
    sbx = Sandbox.create(timeout=120)
    theirs = Sandbox.create(timeout=120, api_key=OTHER_TEAM_KEY)
    try:
        token = sbx._envd_access_token
        assert token and token != theirs._envd_access_token
        url = stack["E2B_SANDBOX_URL"]
        sbx.files.write("/home/user/secret.txt", "mine")
        for credentials in (
            {},
            {"X-Access-Token": ""},
            {"X-Access-Token": "0" * len(token)},
            {"X-Access-Token": theirs._envd_access_token},
            {"X-API-Key": OTHER_TEAM_KEY},
            {"X-API-Key": stack["E2B_API_KEY"]},
        ):
            headers = {"E2b-Sandbox-Id": sbx.sandbox_id, **credentials}
            for method, path, body in (
                ("POST", "/process.Process/List", "{}"),
                ("POST", "/filesystem.Filesystem/ListDir", '{"path": "/home/user"}'),
                ("GET", "/files?path=/home/user/secret.txt", None),
                ("POST", "/files?path=/home/user/planted.txt", "x"),
                ("GET", "/envs", None),
            ):
                r = httpx.request(
                    method, url + path, headers={"Content-Type": "application/json", **headers}, content=body
                )
                assert r.status_code == 401, (credentials, path, r.status_code, r.text)
        assert not sbx.files.exists("/home/user/planted.txt")
        # Another team cannot reach it through the API either.
        with pytest.raises(NotFoundException):
            Sandbox.connect(sbx.sandbox_id, api_key=OTHER_TEAM_KEY)

        # Signed URLs (download_url / upload_url) carry no headers: the host names the sandbox.
        assert sbx.get_host(8080) == f"8080-{sbx.sandbox_id}.{sbx.sandbox_domain}"
        host = {"Host": sbx.get_host(49983)}
        link = sbx.download_url("/home/user/secret.txt", use_signature_expiration=60)
        assert "signature=" in link
        assert httpx.get(link, headers=host).text == "mine"
        assert httpx.get(link.replace("secret.txt", "other.txt"), headers=host).status_code == 401
        upload = sbx.upload_url("/home/user/uploaded.txt")
        r = httpx.post(upload, headers=host, files={"file": ("uploaded.txt", b"through a link")})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/uploaded.txt") == "through a link"
        # A read link does not write.
        r = httpx.post(link, headers=host, files={"file": ("secret.txt", b"overwritten")})
        assert r.status_code == 401
        assert sbx.files.read("/home/user/secret.txt") == "mine"
    finally:
        sbx.kill()
        theirs.kill()


def test_what_envd_0_6_3_and_the_lifecycle_give(stack):
    """File metadata and watch entries (envd 0.6.2/0.6.3, which the SDK enables from the
    version the gateway reports), a network update, an idempotent create, and a paused sandbox
    that outlives its timeout."""
    key = f"e2e-{time.time_ns()}"
    sbx = Sandbox.create(timeout=120, idempotency_key=key)
    try:
        again = Sandbox.create(timeout=120, idempotency_key=key)
        assert again.sandbox_id == sbx.sandbox_id, "a retried create made a second sandbox"
        assert sbx.get_info().envd_version == "0.6.3"

        sbx.files.write("/home/user/tagged.txt", "x", metadata={"owner": "e2e", "kind": "note"})
        assert sbx.files.get_info("/home/user/tagged.txt").metadata == {"owner": "e2e", "kind": "note"}
        sbx.files.make_dir("/home/user/watched")
        handle = sbx.files.watch_dir("/home/user/watched", include_entry=True)
        sbx.files.write("/home/user/watched/new.txt", "y")
        events = []
        for _ in range(100):
            events += handle.get_new_events()
            if any(e.entry is not None for e in events):
                break
            time.sleep(0.05)
        handle.stop()
        assert any(e.entry is not None and e.entry.name == "new.txt" for e in events), events

        sbx.update_network({"allow_internet_access": False})
        assert sbx.get_info().allow_internet_access is False
    finally:
        sbx.kill()

    # Paused by hand past its timeout: still there, and connect resumes it.
    short = Sandbox.create(timeout=1)
    short.files.write("/home/user/kept.txt", "kept")
    short.pause()
    time.sleep(2.5)  # the timeout itself is what is tested: let it pass
    back = Sandbox.connect(short.sandbox_id, timeout=60)
    try:
        assert back.files.read("/home/user/kept.txt") == "kept"
    finally:
        back.kill()


def test_on_resume_reboot_starts_afresh_from_the_files(stack):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        sbx.commands.run("sleep 1000", background=True)
        running = lambda s: "sleep 1000" in s.commands.run("ps -eo args").stdout  # noqa: E731
        assert running(sbx)
        # Restore (the default): where it stood, its processes too.
        sbx.pause()
        restored = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert running(restored)
        # Reboot: the files, and nothing of what ran.
        restored.pause()
        rebooted = Sandbox.connect(sbx.sandbox_id, timeout=60, on_resume="reboot")
        assert rebooted.files.read("/home/user/kept.txt") == "kept"
        assert not running(rebooted)
        assert rebooted.commands.run("echo alive").stdout == "alive\n"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def _rss_mib(pid, field):
    with open(f"/proc/{pid}/status") as status:
        line = next(l for l in status if l.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def test_a_gib_goes_up_and_comes_back_with_bounded_memory(stack):
    """1 GiB up with files.write (an iterable of chunks: streamed) and back with files.read as
    a stream, checked by SHA-256, while the stack's process (the gateway and the nodes, which
    relay every byte) grows by less than 64 MiB at its peak. The bytes are made as they are
    sent, so the client needs neither the memory nor the disk for them; the sandbox's copy
    needs 1 GiB free where the stack keeps its sandboxes."""
    import hashlib
    import shutil

    size = 1 << 30
    pid = stack["pid"]
    free = shutil.disk_usage(stack["state"]).free
    assert free > size + (256 << 20), (
        f"the sandbox's 1 GiB file needs room: {free >> 20} MiB free under {stack['state']}"
    )
    block = bytes(range(256)) * 4096  # 1 MiB
    sent = hashlib.sha256()

    def chunks():
        for i in range(size // len(block)):
            chunk = block[i % 256 :] + block[: i % 256]
            sent.update(chunk)
            yield chunk

    sbx = Sandbox.create(timeout=300)
    try:
        before = _rss_mib(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")  # resets the peak (VmHWM) to what is resident now
        sbx.files.write("/home/user/big.bin", chunks(), request_timeout=600)
        back = hashlib.sha256()
        for piece in sbx.files.read("/home/user/big.bin", format="stream", request_timeout=600):
            back.update(piece)
        assert back.hexdigest() == sent.hexdigest()
        peak = _rss_mib(pid, "VmHWM")
        assert peak - before < 64, f"the stack grew from {before:.0f} to a peak of {peak:.0f} MiB"
    finally:
        sbx.kill()


def test_an_upgraded_connection_to_a_port_is_spliced_both_ways(stack):
    """What WebSocket rides: an HTTP/1.1 Upgrade to a sandbox's port through the gateway (by
    host name) answered 101, then bytes echoed both ways on the same connection."""
    import socket

    server = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', 8765)); s.listen(1)\n"
        "c, _ = s.accept(); head = b''\n"
        "while b'\\r\\n\\r\\n' not in head: head += c.recv(1024)\n"
        "c.sendall(b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: echo\\r\\nConnection: Upgrade\\r\\n\\r\\n')\n"
        "while True:\n"
        "    data = c.recv(1024)\n"
        "    if not data: break\n"
        "    c.sendall(data.upper())\n"
    )
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/echo.py", server)
        sbx.commands.run("python3 /home/user/echo.py", background=True)
        url = httpx.URL(stack["E2B_SANDBOX_URL"])
        for _ in range(100):
            conn = socket.create_connection((url.host, url.port), timeout=10)
            conn.sendall(
                f"GET / HTTP/1.1\r\nHost: {sbx.get_host(8765)}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n".encode()
            )
            answer = b""
            while b"\r\n\r\n" not in answer:
                more = conn.recv(1024)
                if not more:
                    break
                answer += more
            if answer.startswith(b"HTTP/1.1 101"):
                break
            conn.close()  # not listening yet (502): try again
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 101"), answer
        for word in (b"ping", b"spliced both ways"):
            conn.sendall(word)
            echoed = b""
            while len(echoed) < len(word):
                echoed += conn.recv(1024)
            assert echoed == word.upper()
        conn.close()
    finally:
        sbx.kill()


def test_auto_resume_metrics_and_list_filters(stack):
    """Traffic resumes a paused sandbox made with auto_resume; get_metrics is a series that
    grows (the nodes sample every few seconds); list filters by template and start time."""
    import datetime

    started = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    sbx = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True},
                         metadata={"suite": "filters"})
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        sbx.pause()
        assert sbx.get_info().state == "paused"
        # envd traffic to the paused sandbox resumes it, and the request goes through.
        assert sbx.files.read("/home/user/kept.txt") == "kept"
        assert sbx.get_info().state == "running"

        samples = []
        for _ in range(150):
            samples = sbx.get_metrics()
            if len(samples) >= 2:
                break
            time.sleep(0.1)  # the node samples on its own clock: the series is what is tested
        assert len(samples) >= 2, samples
        assert samples[-1].mem_total > 0 and samples[-1].cpu_count >= 1

        query = lambda **kw: [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "filters"}, **kw)).next_items()]  # noqa: E731
        assert query(template="base") == [sbx.sandbox_id]
        assert query(template="no-such-template") == []
        assert query(started_after=started) == [sbx.sandbox_id]
        assert query(started_after=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)) == []
    finally:
        sbx.kill()
