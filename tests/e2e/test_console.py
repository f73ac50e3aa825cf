"""The operator's console in a real browser: Debian's chromium, headless, driven over
WebDriver (chromedriver) against the session's stack, with the Python SDK making the changes
the console must show by itself.

Every page is screenshotted into target/artifacts/console/ (CI keeps that folder)."""

import json
import os
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import OTHER_TEAM_KEY

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("CONSOLE_SCREENSHOTS", ROOT / "target" / "artifacts" / "console"))
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def browser():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} missing: install Debian's chromium and chromium-driver "
                           "(scripts/services does)")
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
                "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    SHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _wait(driver, what, check, timeout=30):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: check(d))
    except Exception as err:  # noqa: BLE001 - re-raised with what was awaited and the page
        shot = SHOTS / f"failed-{int(time.time())}.png"
        driver.save_screenshot(str(shot))
        raise AssertionError(f"timed out waiting for {what} (page in {shot}): {err}") from err


def _sign_in(driver, stack, token=None):
    driver.get(stack["console"] + "/login")
    driver.find_element(By.ID, "token").send_keys(token or stack["admin_token"])
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    if token is None:
        _wait(driver, "the cluster page after signing in", lambda d: d.current_url.endswith("/console/cluster"))


def _mark(driver):
    """Marks the page: a reload (or a navigation) loses the mark."""
    driver.execute_script("window.__notReloaded = true")


def _text(driver, selector):
    """The text of the first element `selector` finds, read in the page in one go (pages redraw
    rows as events arrive, so an element found first and read later may be gone)."""
    return driver.execute_script("return document.querySelector(arguments[0])?.textContent ?? null", selector)


def _not_reloaded(driver):
    return driver.execute_script("return window.__notReloaded === true")


def _call(stack, method, path, headers=None, body=None, base=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request((base or stack["console"].removesuffix("/console")) + path, data=data,
                                     method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_only_the_admin_token_opens_the_console(stack, browser):
    # A page without a session sends the browser to the form.
    browser.delete_all_cookies()
    browser.get(stack["console"] + "/cluster")
    assert browser.current_url.endswith("/console/login")
    browser.save_screenshot(str(SHOTS / "login.png"))
    # Both teams' API keys are refused, with the reason.
    for key in (stack["E2B_API_KEY"], OTHER_TEAM_KEY):
        _sign_in(browser, stack, token=key)
        error = _wait(browser, "the refusal", lambda d: d.find_elements(By.ID, "login-error"))
        assert "team's API key does not open the console" in error[0].text
        assert not browser.get_cookies(), "a refused sign-in set a cookie"
    # The API: no session, a team key, a forged cookie: 401 in {code, message}.
    for headers in ({}, {"X-Admin-Token": stack["E2B_API_KEY"]}, {"Cookie": "sandboxsched_console=forged"}):
        status, body = _call(stack, "GET", "/console/api/cluster", headers)
        assert status == 401, (headers, status, body)
        assert json.loads(body)["code"] == 401
    # An action from another origin is refused even with the operator's token.
    status, body = _call(stack, "POST", "/console/api/balance/pause",
                         {"X-Admin-Token": stack["admin_token"], "Origin": "http://evil.example",
                          "Content-Type": "application/json"}, {"paused": True})
    assert status == 400 and b"own page" in body, (status, body)
    # A page whose DNS name was rebound to the console's address names another host: refused.
    status, body = _call(stack, "GET", "/console/login", {"Host": "attacker.example:80"})
    assert status == 421, (status, body)
    # A signed-in browser's action must name the console as its origin (or be same-origin).
    _sign_in(browser, stack)
    session = next(c["value"] for c in browser.get_cookies() if c["name"] == "sandboxsched_console")
    status, body = _call(stack, "POST", "/console/api/balance/pause",
                         {"Cookie": f"sandboxsched_console={session}", "Content-Type": "application/json"},
                         {"paused": True})
    assert status == 400 and b"names no origin" in body, (status, body)
    browser.find_element(By.CSS_SELECTOR, "header form button[type=submit]").click()
    _wait(browser, "the sign-in form after signing out", lambda d: d.current_url.endswith("/console/login"))
    status, _ = _call(stack, "GET", "/console/api/cluster", {"Cookie": f"sandboxsched_console={session}"})
    assert status == 401, "a signed-out session still reads the cluster"
    # Every answer forbids scripts from anywhere but the console itself.
    request = urllib.request.Request(stack["console"] + "/login")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    _sign_in(browser, stack)
    cookie = next(c for c in browser.get_cookies() if c["name"] == "sandboxsched_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict", cookie


def test_the_cluster_page_draws_each_node_from_its_document(stack, browser):
    _sign_in(browser, stack)
    status, body = _call(stack, "GET", "/nodes", {"X-Admin-Token": stack["admin_token"]}, base=stack["E2B_API_URL"])
    assert status == 200, body
    placement = {n["nodeID"]: n for n in json.loads(body)}
    assert len(placement) == 2
    # Rows are redrawn whole as documents arrive: each is read in one go, in the page.
    read_rows = """
        return [...document.querySelectorAll('tbody tr[data-node-id]')].map((row) => {
          const meter = row.querySelector('[role=meter]');
          return {node: row.dataset.nodeId, capacity: +meter.getAttribute('aria-valuemax'),
                  used: +meter.getAttribute('aria-valuenow'), bar: meter.getBoundingClientRect().width,
                  drawn: meter.querySelector('.used').getBoundingClientRect().width,
                  state: row.querySelector('.pill').textContent};
        });"""
    rows = _wait(browser, "both nodes' rows", lambda d: (r := d.execute_script(read_rows)) and len(r) == 2 and r)
    for row in rows:
        node, capacity, used = row["node"], row["capacity"], row["used"]
        # The capacity is the node's own; what it uses moves a little between two reads.
        assert capacity == placement[node]["memoryMB"], (row, placement[node])
        assert abs(used - placement[node]["memoryUsedMiB"]) < 256, (row, placement[node])
        # The bar's length is what it says.
        assert abs(row["drawn"] / row["bar"] - used / capacity) < 0.02, row
        assert row["state"] in ("ready", "draining"), row
    # The accessible names an operator's tools find the controls by.
    assert browser.find_elements(By.CSS_SELECTOR, "button[aria-label^='Drain ']")
    assert browser.find_element(By.CSS_SELECTOR, "nav a[aria-current=page]").text == "Cluster"
    browser.save_screenshot(str(SHOTS / "cluster.png"))
    browser.find_element(By.ID, "theme").click()
    browser.save_screenshot(str(SHOTS / "cluster-other-theme.png"))
    browser.find_element(By.ID, "theme").click()


def test_sandboxes_created_with_the_sdk_appear_without_a_reload(stack, browser):
    _sign_in(browser, stack)
    browser.get(stack["console"] + "/sandboxes")
    _wait(browser, "the live stream", lambda d: d.find_element(By.ID, "live").get_attribute("data-state") == "live")
    _mark(browser)
    made = [Sandbox.create(timeout=300, metadata={"console": "e2e"}) for _ in range(2)]
    try:
        for s in made:
            _wait(browser, f"{s.sandbox_id} in the table", lambda d, s=s: d.find_elements(By.ID, f"sbx-{s.sandbox_id}"))
        assert _not_reloaded(browser), "the page reloaded to show them"
        # Search filters on the server.
        box = browser.find_element(By.ID, "search")
        box.send_keys(made[0].sandbox_id)
        _wait(browser, "the search's one match",
              lambda d: d.find_element(By.ID, "matched").text.startswith("1 of "))
        assert browser.find_elements(By.ID, f"sbx-{made[0].sandbox_id}")
        assert not browser.find_elements(By.ID, f"sbx-{made[1].sandbox_id}")
        browser.save_screenshot(str(SHOTS / "sandboxes.png"))
        # One sandbox: where it runs, its manifest's history, placement's candidates, its log.
        browser.execute_script("document.querySelector(`#sbx-${arguments[0]} a`).click()", made[0].sandbox_id)
        facts = _wait(browser, "its facts", lambda d: _text(d, "#facts"))
        assert made[0].sandbox_id in facts and "running" in facts, facts
        history = _wait(browser, "its history", lambda d: _text(d, "#history tbody tr"))
        assert "created" in history, history
        assert "sandbox created" in _text(browser, "#sandbox-log")
        browser.save_screenshot(str(SHOTS / "sandbox.png"))
        # A kill shows on the table without a reload too.
        browser.get(stack["console"] + "/sandboxes")
        _wait(browser, "the table", lambda d: d.find_elements(By.ID, f"sbx-{made[1].sandbox_id}"))
        _mark(browser)
        made[1].kill()
        _wait(browser, "the killed sandbox gone", lambda d: not d.find_elements(By.ID, f"sbx-{made[1].sandbox_id}"))
        assert _not_reloaded(browser)
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - cleanup reaches every sandbox
                pass


# Records every step the page draws for a sandbox's move, as the page draws it.
RECORD_STEPS = """
window.__steps = [];
const id = arguments[0];
new MutationObserver(() => {
  for (const row of document.querySelectorAll(`tr.move[data-sandbox-id="${id}"]`)) {
    const step = row.dataset.step;
    if (window.__steps[window.__steps.length - 1] !== step) window.__steps.push(step);
  }
}).observe(document.getElementById("app"), {childList: true, subtree: true, attributes: true});
"""


def test_a_drain_started_in_the_console_moves_a_sandbox_live(stack, browser):
    _sign_in(browser, stack)
    sandbox = Sandbox.create(timeout=300)
    drained = None
    try:
        sandbox.files.write("keep.txt", "still mine")
        status, body = _call(stack, "GET", f"/console/api/sandboxes/{sandbox.sandbox_id}",
                             {"X-Admin-Token": stack["admin_token"]})
        assert status == 200, body
        detail = json.loads(body)
        drained = detail["sandbox"]["nodeId"]
        # The other node must have room for it, or the drain rightly leaves it where it is.
        others = [c for c in detail["explain"]["candidates"] if c["nodeId"] != drained]
        assert any(c["feasible"] for c in others), f"no other node could take it: {detail['explain']}"
        drained = detail["sandbox"]["nodeId"]
        browser.get(stack["console"] + "/balance")
        button = _wait(browser, f"the drain button of {drained}",
                       lambda d: d.find_elements(By.CSS_SELECTOR, f"button[aria-label='Drain {drained}']"))
        _mark(browser)
        browser.execute_script(RECORD_STEPS, sandbox.sandbox_id)
        button[0].click()
        dialog = _wait(browser, "the confirmation", lambda d: d.find_element(By.ID, "confirm").is_displayed()
                       and d.find_element(By.ID, "confirm"))
        assert drained in dialog.text
        browser.find_element(By.ID, "confirm-ok").click()
        _wait(browser, "the drain's progress", lambda d: d.find_elements(By.CSS_SELECTOR, "#drains progress"))
        _wait(browser, "the move done", lambda d: d.find_elements(
            By.CSS_SELECTOR, f"tr.move[data-sandbox-id='{sandbox.sandbox_id}'][data-step='Done']"), timeout=60)
        steps = browser.execute_script("return window.__steps")
        order = ["Planned", "Owned", "SourcePaused", "Restored", "TargetResumed", "Switched", "Done"]
        assert steps and steps[-1] == "Done", steps
        assert len(steps) >= 2, f"only the finished move was drawn, no step of it live: {steps}"
        assert [order.index(s) for s in steps] == sorted(order.index(s) for s in steps), steps
        assert _not_reloaded(browser), "the move showed only after a reload"
        browser.save_screenshot(str(SHOTS / "balance.png"))
        print(f"steps drawn live for the move of {sandbox.sandbox_id} off {drained}: {steps}")
        # It moved, and it is the same sandbox.
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.commands.run("cat keep.txt").stdout == "still mine"
        status, body = _call(stack, "GET", f"/console/api/sandboxes/{sandbox.sandbox_id}",
                             {"X-Admin-Token": stack["admin_token"]})
        assert json.loads(body)["sandbox"]["nodeId"] != drained
    finally:
        if drained:
            _call(stack, "POST", f"/console/api/nodes/{drained}/drain",
                  {"X-Admin-Token": stack["admin_token"], "Content-Type": "application/json"}, {"undo": True})
        sandbox.kill()


def test_a_builds_log_streams_while_it_builds(stack, browser):
    _sign_in(browser, stack)
    name = f"e2e-console-{uuid.uuid4().hex[:8]}"
    template = Template().from_template("base").run_cmd("echo first-line; sleep 4; echo second-line")
    info = Template.build_in_background(template, name)
    try:
        browser.get(f"{stack['console']}/builds/{info.build_id}")
        _mark(browser)
        # The status the page showed when the first line arrived: still building.
        browser.execute_script("""
            new MutationObserver(() => {
              const log = document.getElementById('build-log');
              if (!window.__firstSeenWhile && log && log.textContent.includes('first-line'))
                window.__firstSeenWhile = document.getElementById('build-status').dataset.status;
            }).observe(document.getElementById('app'), {childList: true, subtree: true, characterData: true});
        """)
        _wait(browser, "the build's end",
              lambda d: d.find_element(By.ID, "build-status").get_attribute("data-status") == "ready", timeout=120)
        log = browser.find_element(By.ID, "build-log").text
        assert "first-line" in log and "second-line" in log, log
        assert log.index("first-line") < log.index("second-line")
        assert _not_reloaded(browser)
        first_seen_while = browser.execute_script("return window.__firstSeenWhile")
        assert first_seen_while in ("waiting", "building"), \
            f"the first line was drawn only once the build was {first_seen_while}: nothing streamed"
        browser.save_screenshot(str(SHOTS / "build.png"))
        browser.get(stack["console"] + "/templates")
        _wait(browser, "the template's row",
              lambda d: d.find_elements(By.CSS_SELECTOR, f"tr[data-template-id='{info.template_id}']"))
        browser.save_screenshot(str(SHOTS / "templates.png"))
    finally:
        _call(stack, "DELETE", f"/templates/{info.template_id}", {"X-API-Key": stack["E2B_API_KEY"]},
              base=stack["E2B_API_URL"])
