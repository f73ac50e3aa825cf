"""Templates through the E2B Python SDK: build with `Template().…` and `Template.build`, then
start sandboxes of them by name, exactly as an E2B user does; the registry image test pushes
its own image to a registry on loopback (scripts/blob-services starts one)."""

import gzip
import hashlib
import io
import json
import os
import tarfile
import uuid

import httpx
import pytest
from conftest import OTHER_TEAM_KEY
from e2b import BuildException, Sandbox, Template, wait_for_file, wait_for_port

REGISTRY = os.environ.get("BLOBS_TEST_REGISTRY", "127.0.0.1:5056")
# A registry address the stack allows (conftest) where nothing listens.
UNREACHABLE = "127.0.0.1:5059"
BUSYBOX = "/bin/busybox"


def _api(method, path, key=None, **kw):
    url = os.environ["E2B_API_URL"] + path
    headers = {"X-API-Key": key or os.environ["E2B_API_KEY"]}
    return httpx.request(method, url, headers=headers, timeout=30, **kw)


def test_a_template_built_from_base_runs_as_built(stack, tmp_path):
    name = f"e2e-app-{uuid.uuid4().hex[:8]}"
    (tmp_path / "hello.txt").write_text("hello from the build context\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("hello.txt", "/home/user/app/")
        .run_cmd("echo built-by-$(id -un) > /home/user/app/built.txt")
        .set_workdir("/home/user/app")
        .set_envs({"GREETING": "hi-from-template"})
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )
    logs = []
    Template.build(template, f"{name}:v1", on_build_logs=logs.append)
    messages = [entry.message for entry in logs]
    assert any("RUN echo built" in m for m in messages), messages
    assert Template.exists(name)
    assert not Template.exists(f"nope-{uuid.uuid4().hex[:8]}")

    sbx = Sandbox.create(f"{name}:v1", timeout=120)
    try:
        # The copied file, owned by the user, in the template's working directory.
        assert sbx.commands.run("cat hello.txt").stdout == "hello from the build context\n"
        assert sbx.commands.run("pwd").stdout == "/home/user/app\n"
        assert sbx.commands.run("stat -c %U hello.txt built.txt").stdout == "user\nuser\n"
        assert sbx.commands.run("cat built.txt").stdout == "built-by-user\n"
        assert sbx.commands.run("echo $GREETING").stdout == "hi-from-template\n"
        # The start command runs, and create returned once it was ready.
        probe = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/').status)\""
        assert sbx.commands.run(probe).stdout == "200\n"
    finally:
        sbx.kill()

    # Tags: another tag of the same build, and a create by it.
    Template.assign_tags(f"{name}:v1", ["prod"])
    assert {t.tag for t in Template.get_tags(name)} >= {"v1", "prod"}
    sbx = Sandbox.create(f"{name}:prod", timeout=60)
    sbx.kill()

    # The same steps again: every step comes from the build cache. (How much faster that is
    # belongs to `bench template-build`; here both builds are under a second, dominated by the
    # SDK's status polling, and comparing them failed CI once: 0.469 s against 0.464 s.)
    logs.clear()
    Template.build(template, f"{name}:v2", on_build_logs=logs.append)
    assert sum("CACHED" in e.message for e in logs) >= 3, [e.message for e in logs]

    # Another team sees none of it.
    other = _api("GET", f"/templates/aliases/{name}", key=OTHER_TEAM_KEY)
    assert other.status_code == 403, other.text
    denied = _api("POST", "/sandboxes", key=OTHER_TEAM_KEY, json={"templateID": name})
    assert denied.status_code == 404, denied.text

    # Deleting it never breaks a sandbox that runs it; new creates are refused.
    sbx = Sandbox.create(f"{name}:v2", timeout=60)
    try:
        templates = _api("GET", "/templates").json()
        template_id = next(t["templateID"] for t in templates if name in t["names"])
        assert _api("DELETE", f"/templates/{template_id}").status_code == 204
        assert sbx.commands.run("cat hello.txt").exit_code == 0
        assert _api("POST", "/sandboxes", json={"templateID": name}).status_code == 404
        assert not Template.exists(name)
    finally:
        sbx.kill()


def test_a_failing_step_fails_the_build_with_its_output(stack):
    name = f"e2e-broken-{uuid.uuid4().hex[:8]}"
    template = Template().from_template("base").run_cmd("echo boom-output; exit 3")
    with pytest.raises(BuildException) as failed:
        Template.build(template, name)
    assert "boom-output" in str(failed.value) and "3" in str(failed.value), str(failed.value)
    # Nothing is registered under the name: a create finds no ready build.
    assert _api("POST", "/sandboxes", json={"templateID": name}).status_code == 404


def test_an_unknown_base_image_fails_with_a_message(stack):
    name = f"e2e-noimage-{uuid.uuid4().hex[:8]}"
    template = Template().from_image(f"{REGISTRY}/e2e/does-not-exist:1").run_cmd("true")
    with pytest.raises(BuildException) as failed:
        Template.build(template, name)
    assert "does-not-exist" in str(failed.value), str(failed.value)
    assert _api("POST", "/sandboxes", json={"templateID": name}).status_code == 404


def test_an_unreachable_registry_fails_with_a_message(stack):
    # Allowed (the stack names it a private registry) but nothing listens there.
    name = f"e2e-unreachable-{uuid.uuid4().hex[:8]}"
    template = Template().from_image(f"{UNREACHABLE}/e2e/anything:1").run_cmd("true")
    with pytest.raises(BuildException) as failed:
        Template.build(template, name)
    assert UNREACHABLE in str(failed.value), str(failed.value)
    assert _api("POST", "/sandboxes", json={"templateID": name}).status_code == 404


@pytest.mark.parametrize("image", ["169.254.169.254/latest/meta-data:1", "10.0.0.1:5000/internal:1", "127.0.0.1:6379/redis:1"])
def test_a_build_cannot_make_the_node_fetch_from_private_addresses(stack, image):
    # The cloud's metadata service, the operator's network, the node's own loopback (Redis):
    # a template names any registry, and the node must not become the way in.
    template = Template().from_image(image).run_cmd("true")
    with pytest.raises(BuildException) as failed:
        Template.build(template, f"e2e-ssrf-{uuid.uuid4().hex[:8]}")
    assert "may not reach" in str(failed.value), str(failed.value)


def _registry_up():
    try:
        return httpx.get(f"http://{REGISTRY}/v2/", timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def _busybox_layer(passwd="root:x:0:0:root:/root:/bin/sh\n"):
    """A root filesystem of Debian's static busybox: /bin/busybox and a link per applet, and
    `passwd` as /etc/passwd (None: no passwd or group file at all)."""
    if not os.path.exists(BUSYBOX):
        raise RuntimeError(f"{BUSYBOX} is missing: install busybox-static (scripts/blob-services does)")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for d in ("bin", "etc", "tmp", "root", "home", "usr", "usr/bin"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, arcname="bin/busybox")
        for applet in ("sh", "cat", "echo", "id", "ls", "grep", "mkdir", "chown", "stat", "env", "pwd", "sleep", "true", "readlink", "touch", "test", "["):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
        accounts = () if passwd is None else (("etc/passwd", passwd), ("etc/group", "root:x:0:\n"))
        for path, text in accounts:
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    return gzip.compress(plain, mtime=0), hashlib.sha256(plain).hexdigest()


def _push(repository, tag, passwd="root:x:0:0:root:/root:/bin/sh\n", workdir="/", user=None):
    """Pushes a one-layer busybox image with the registry's HTTP API (OCI distribution): its
    /etc/passwd (None: none), its config's WorkingDir and User (None: not set)."""
    layer, diff_id = _busybox_layer(passwd)
    image_config = {"Env": ["PATH=/bin:/usr/bin", "IMAGE_VAR=from-the-image"]}
    if workdir is not None:
        image_config["WorkingDir"] = workdir
    if user is not None:
        image_config["User"] = user
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        }
    ).encode()
    base = f"http://{REGISTRY}/v2/{repository}"
    for blob in (layer, config):
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        start = httpx.post(f"{base}/blobs/uploads/", timeout=30)
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        if location.startswith("/"):
            location = f"http://{REGISTRY}{location}"
        sep = "&" if "?" in location else "?"
        put = httpx.put(f"{location}{sep}digest={digest}", content=blob, timeout=60,
                        headers={"Content-Type": "application/octet-stream"})
        assert put.status_code == 201, put.text
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
            "size": len(config),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": "sha256:" + hashlib.sha256(layer).hexdigest(),
                "size": len(layer),
            }
        ],
    }
    put = httpx.put(f"{base}/manifests/{tag}", content=json.dumps(manifest).encode(), timeout=30,
                    headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert put.status_code == 201, put.text


def test_a_template_from_a_registry_image_has_that_root(stack, tmp_path):
    if not _registry_up():
        raise RuntimeError(f"no registry answers at {REGISTRY}: run scripts/blob-services")
    repository = f"e2e/busybox-{uuid.uuid4().hex[:8]}"
    _push(repository, "1")
    name = f"e2e-busybox-{uuid.uuid4().hex[:8]}"
    (tmp_path / "app.conf").write_text("copied into busybox\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image(f"{REGISTRY}/{repository}:1")
        .copy("app.conf", "/home/user/app/")
        .run_cmd("echo made-in-busybox > /greeting", user="root")
        .set_workdir("/home/user/app")
        .set_envs({"TEMPLATE_VAR": "from-the-template"})
        .set_start_cmd("touch /tmp/started; sleep 600", wait_for_file("/tmp/started"))
    )
    logs = []
    Template.build(template, name, on_build_logs=logs.append)
    sbx = Sandbox.create(name, timeout=60)
    try:
        assert sbx.commands.run("cat /greeting").stdout == "made-in-busybox\n"
        assert sbx.commands.run("cat app.conf; pwd").stdout == "copied into busybox\n/home/user/app\n"
        assert sbx.commands.run("echo $TEMPLATE_VAR").stdout == "from-the-template\n"
        assert sbx.commands.run("test -f /tmp/started && echo started").stdout == "started\n"
        # The image's own root, not the host's: no python, busybox as every tool.
        assert sbx.commands.run("ls /usr/bin").stdout == ""
        assert sbx.commands.run("readlink /bin/sh").stdout == "busybox\n"
        # E2B's user, added by the build, is the default one.
        assert sbx.commands.run("id -un").stdout == "user\n"
        assert sbx.commands.run("echo $IMAGE_VAR").stdout == "from-the-image\n"
        sbx.files.write("/home/user/note.txt", "written through envd")
        assert sbx.files.read("/home/user/note.txt") == "written through envd"
    finally:
        sbx.kill()


APP = "root:x:0:0:root:/root:/bin/sh\napp:x:1234:1234::/home/app:/bin/sh\n"


@pytest.mark.parametrize(
    "image, build_ids, sandbox_ids",
    [
        # No /etc/passwd at all (as FROM scratch): root is uid 0; the build adds E2B's user,
        # who runs the steps of an image with no USER, as E2B's builds do.
        # (Its WorkingDir is `/`: there everything starts.)
        (dict(passwd=None), "1000 /", "user /"),
        # No WorkingDir (busybox's, Debian's and Alpine's official images have none).
        (dict(workdir=None), "1000 /home/user", "user /home/user"),
        # A non-root USER by name, whose home the image lacks: it runs the steps and is the
        # sandbox's default user, starting in `/` as Docker starts it.
        (dict(passwd=APP, workdir=None, user="app"), "1234 /", "app /"),
        # ... and by uid.
        (dict(passwd=APP, user="1234"), "1234 /", "app /"),
    ],
    ids=["no-passwd", "no-workdir", "user-by-name", "user-by-uid"],
)
def test_images_run_as_docker_runs_them(stack, image, build_ids, sandbox_ids):
    if not _registry_up():
        raise RuntimeError(f"no registry answers at {REGISTRY}: run scripts/blob-services")
    repository = f"e2e/plain-{uuid.uuid4().hex[:8]}"
    _push(repository, "1", **image)
    name = f"e2e-plain-{uuid.uuid4().hex[:8]}"
    template = Template().from_image(f"{REGISTRY}/{repository}:1").run_cmd("echo $(id -u) $(pwd) > /tmp/built")
    Template.build(template, name, on_build_logs=lambda _: None)
    sbx = Sandbox.create(name, timeout=60)
    try:
        assert sbx.commands.run("cat /tmp/built").stdout == build_ids + "\n"
        assert sbx.commands.run("echo $(id -un) $(pwd)").stdout == sandbox_ids + "\n"
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
    finally:
        sbx.kill()


def test_snapshots_and_forks_start_from_the_sandboxs_files(stack):
    sbx = Sandbox.create(timeout=120, envs={"FROM_SOURCE": "yes"})
    try:
        sbx.files.write("/home/user/state.txt", "before")
        name = f"e2e-snap-{uuid.uuid4().hex[:8]}"
        snapshot = sbx.create_snapshot(name=name)
        assert snapshot.snapshot_id == f"{name}:default"
        # The source runs on, changed after the snapshot.
        sbx.files.write("/home/user/state.txt", "after")
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [snapshot.snapshot_id]

        restored = Sandbox.create(snapshot.snapshot_id, timeout=60)
        try:
            assert restored.files.read("/home/user/state.txt") == "before"
            assert restored.commands.run("echo $FROM_SOURCE").stdout == "yes\n"
        finally:
            restored.kill()

        forks = sbx.fork(count=3, timeout=60)
        assert len(forks) == 3 and all(isinstance(f, Sandbox) for f in forks), forks
        try:
            assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 4
            for f in forks:
                assert f.files.read("/home/user/state.txt") == "after"
        finally:
            for f in forks:
                f.kill()

        assert Sandbox.delete_snapshot(snapshot.snapshot_id)
        assert _api("POST", "/sandboxes", json={"templateID": snapshot.snapshot_id}).status_code == 404
    finally:
        sbx.kill()
