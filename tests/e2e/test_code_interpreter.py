"""E2B's code interpreter as its users run it: the pinned `e2b-code-interpreter` from PyPI,
unmodified, against the local stack's `code-interpreter-v1` (built by the stack itself), with
real Jupyter kernels behind it."""

import base64
import re
import threading
import time

import httpx
import pytest
from e2b import NotFoundException, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import BarChart, BoxAndWhiskerChart, LineChart, PieChart, ScatterChart, SuperChart


@pytest.fixture(scope="module")
def sbx(code_interpreter):
    sandbox = Sandbox.create(timeout=600)
    yield sandbox
    sandbox.kill()


def test_the_default_template_keeps_state_and_answers_the_last_expression(sbx):
    first = sbx.run_code("x = 40")
    assert first.results == [] and first.error is None
    second = sbx.run_code("x + 2")
    assert second.text == "42"
    assert [r.is_main_result for r in second.results] == [True]
    assert second.execution_count > first.execution_count


def test_display_data_are_further_results_beside_the_main_one(sbx):
    execution = sbx.run_code(
        "from IPython.display import display, HTML, Markdown\n"
        "display(HTML('<b>bold</b>'))\n"
        "display(Markdown('*md*'))\n"
        "7"
    )
    assert [r.is_main_result for r in execution.results] == [False, False, True]
    assert execution.results[0].html == "<b>bold</b>"
    assert execution.results[1].markdown == "*md*"
    assert execution.text == "7"


def test_a_matplotlib_figure_comes_back_as_png(sbx):
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_a_dataframe_comes_back_as_html_and_text(sbx):
    execution = sbx.run_code("import pandas as pd\npd.DataFrame({'city': ['Oslo', 'Lima'], 'n': [1, 2]})")
    main = execution.results[0]
    assert "<table" in main.html and "Oslo" in main.html
    assert "Lima" in main.text


def test_output_streams_while_the_code_runs(sbx):
    arrivals = []
    started = time.monotonic()
    execution = sbx.run_code(
        "import sys, time\nprint('first', flush=True)\nprint('warn', file=sys.stderr, flush=True)\n"
        "time.sleep(3)\nprint('second')",
        on_stdout=lambda m: arrivals.append(("out", m.line, time.monotonic() - started)),
        on_stderr=lambda m: arrivals.append(("err", m.line, time.monotonic() - started)),
    )
    ended = time.monotonic() - started
    lines = [(kind, line) for kind, line, _ in arrivals]
    assert lines == [("out", "first\n"), ("err", "warn\n"), ("out", "second\n")]
    # The first line came while the cell slept, not with the end of the call.
    assert ended - arrivals[0][2] > 2.0, (arrivals, ended)
    assert execution.logs.stdout == ["first\n", "second\n"]
    assert execution.logs.stderr == ["warn\n"]


def test_an_error_has_name_value_and_traceback_and_the_kernel_survives(sbx):
    seen = []
    execution = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=seen.append)
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    # Jupyter's traceback, colours and all (as E2B's is).
    plain = re.sub(r"\x1b\[[0-9;]*m", "", execution.error.traceback)
    assert "----> 3 f()" in plain and "return 1 / 0" in plain, plain
    assert seen == [execution.error]
    assert sbx.run_code("1 + 1").text == "2"


def test_env_vars_hold_for_one_call_and_the_sandbox_envs_for_all(code_interpreter):
    sandbox = Sandbox.create(envs={"TEAM_SETTING": "everywhere"}, timeout=300)
    try:
        assert sandbox.run_code("import os; os.environ['ONE_CALL']", envs={"ONE_CALL": "only now"}).text == "'only now'"
        assert sandbox.run_code("'ONE_CALL' in os.environ").text == "False"
        assert sandbox.run_code("os.environ['TEAM_SETTING']").text == "'everywhere'"
        bash = sandbox.run_code("echo $ONE_CALL", language="bash", envs={"ONE_CALL": "in bash"})
        assert bash.logs.stdout == ["in bash\n"]
    finally:
        sandbox.kill()


def test_contexts_are_separate_kernels_that_restart_and_go(sbx):
    ctx = sbx.create_code_context(cwd="/tmp")
    assert (ctx.language, ctx.cwd) == ("python", "/tmp")
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    sbx.run_code("only_in_ctx = 1", context=ctx)
    assert sbx.run_code("only_in_ctx", context=ctx).text == "1"
    assert sbx.run_code("only_in_ctx").error.name == "NameError"
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]

    sbx.restart_code_context(ctx)
    assert sbx.run_code("only_in_ctx", context=ctx).error.name == "NameError"

    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)


def test_a_timeout_interrupts_the_kernel_and_leaves_the_context_usable(sbx):
    sbx.run_code("kept = 'still here'")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(120)", timeout=2)
    started = time.monotonic()
    assert sbx.run_code("kept").text == "'still here'"
    # The sleep was interrupted, not waited out behind the next call.
    assert time.monotonic() - started < 30


def test_bash_keeps_its_directory_and_variables(sbx):
    first = sbx.run_code("cd /tmp && export KEPT=3 && echo hello", language="bash")
    assert first.logs.stdout == ["hello\n"] and first.error is None
    # (Output comes in chunks as the shell writes it.)
    assert "".join(sbx.run_code("echo $KEPT; pwd; whoami", language="bash").logs.stdout) == "3\n/tmp\nuser\n"
    failed = sbx.run_code("echo to-stderr >&2; exit 4", language="bash")
    assert failed.logs.stderr == ["to-stderr\n"]
    assert failed.error.name == "ExitCode" and failed.error.value == "exit status 4"
    # `exit` ended that call, not the context's state.
    assert "".join(sbx.run_code("echo $KEPT; pwd", language="bash").logs.stdout) == "3\n/tmp\n"


def test_figures_come_with_their_data_as_e2b_charts(sbx):
    """Beside the PNG, each figure's data as the SDK's typed charts (`result.chart`)."""
    line = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [4, 5, 6], label='rising')\nplt.title('Growth'); plt.xlabel('day')\nplt.show()"
    )
    chart = line.results[0].chart
    assert isinstance(chart, LineChart) and line.results[0].png
    assert (chart.title, chart.x_label, chart.x_scale.value) == ("Growth", "day", "linear")
    assert [(e.label, e.points) for e in chart.elements] == [("rising", [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)])]
    bars = sbx.run_code("plt.bar(['a', 'b'], [3, 4], label='sales')\nplt.show()").results[0].chart
    assert isinstance(bars, BarChart)
    assert [(e.label, e.group, e.value) for e in bars.elements] == [("a", "sales", 3.0), ("b", "sales", 4.0)]
    pie = sbx.run_code("plt.pie([1, 3], labels=['p', 'q'])\nplt.show()").results[0].chart
    assert isinstance(pie, PieChart) and [(e.label, round(e.angle)) for e in pie.elements] == [("p", 90), ("q", 270)]
    box = sbx.run_code("plt.boxplot([[1, 2, 3, 4, 10]])\nplt.show()").results[0].chart
    assert isinstance(box, BoxAndWhiskerChart)
    assert (box.elements[0].median, box.elements[0].outliers) == (3.0, [10.0])
    both = sbx.run_code(
        "fig, (a, b) = plt.subplots(1, 2)\nfig.suptitle('Two')\na.scatter([1, 2], [3, 4])\nb.plot([0, 1])\nplt.show()"
    ).results[0].chart
    assert isinstance(both, SuperChart) and both.title == "Two"
    assert [type(c) for c in both.elements] == [ScatterChart, LineChart]


def test_javascript_keeps_its_declarations_awaits_and_is_interrupted(sbx):
    ctx = sbx.create_code_context(language="javascript", cwd="/tmp")
    first = sbx.run_code("const base = 40\nfunction add(x) { return x + 2 }\nconsole.log('from node')", context=ctx)
    assert first.logs.stdout == ["from node\n"] and first.error is None
    assert sbx.run_code("add(base)", context=ctx).text == "42"
    # Top-level await: what it declares at the start of a line later cells see.
    awaited = sbx.run_code("const later = await new Promise((r) => setTimeout(() => r(5), 50))\nlater * 2", context=ctx)
    assert awaited.text == "10"
    assert sbx.run_code("later + base + process.cwd().length", context=ctx).text == "49"
    failed = sbx.run_code("null.x", context=ctx)
    assert failed.error.name == "TypeError" and "null" in failed.error.value
    assert "cell.js" in failed.error.traceback and "javascript.js" not in failed.error.traceback
    env = sbx.run_code("process.env.ONE_CALL", context=ctx, envs={"ONE_CALL": "js"})
    assert env.text == "'js'"
    assert sbx.run_code("process.env.ONE_CALL", context=ctx).text is None
    # A loop that never yields is interrupted where it stands; the context keeps its state.
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", context=ctx, timeout=2)
    assert sbx.run_code("base", context=ctx).text == "40"
    # The SDK's language names reach the same kind of context.
    assert sbx.run_code("typeof require('node:fs').readFileSync", language="js").text == "'function'"
    sbx.remove_code_context(ctx)


@pytest.mark.parametrize("language", ["r", "typescript", "java"])
def test_a_language_without_a_kernel_is_refused_by_name(sbx, language):
    with pytest.raises(SandboxException) as refused:
        sbx.run_code("1", language=language)
    assert "400" in str(refused.value) and f"'{language}'" in str(refused.value)


def test_files_written_by_code_are_read_through_the_files_api_and_back(sbx):
    sbx.run_code("open('/home/user/from_kernel.txt', 'w').write('written by the kernel')")
    assert sbx.files.read("/home/user/from_kernel.txt") == "written by the kernel"
    sbx.files.write("/home/user/from_api.txt", "written through the API")
    assert sbx.run_code("open('from_api.txt').read()").text == "'written through the API'"


def test_two_sandboxes_kernels_are_independent(code_interpreter):
    a, b = Sandbox.create(timeout=300), Sandbox.create(timeout=300)
    try:
        a.run_code("secret = 'a'")
        assert b.run_code("secret").error.name == "NameError"
        # Calls to the two at once do not wait for each other.
        results = {}
        threads = [
            threading.Thread(target=lambda s=s, n=n: results.__setitem__(n, s.run_code("import time; time.sleep(3); 5").text))
            for n, s in (("a", a), ("b", b))
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {"a": "5", "b": "5"}
        assert time.monotonic() - started < 5.5
    finally:
        a.kill()
        b.kill()


async def _async_round_trip():
    sandbox = await AsyncSandbox.create(timeout=120)
    try:
        execution = await sandbox.run_code("sum(range(10))")
        return execution.text
    finally:
        await sandbox.kill()


def test_the_async_sdk_runs_code_too(code_interpreter):
    import asyncio

    assert asyncio.run(_async_round_trip()) == "45"


def test_the_server_answers_only_the_sandboxs_access_token(sbx, code_interpreter):
    """The server runs whatever it is sent as the sandbox's user: knowing the sandbox's ID
    (it is in every host name) must not be enough to reach it, by headers or by host name."""
    url = code_interpreter["E2B_SANDBOX_URL"]
    by_headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    by_host = {"Host": sbx.get_host(49999)}
    cell = {"code": "open('/tmp/pwned', 'w').write('x')"}
    for headers in (by_headers, {**by_headers, "X-Access-Token": "not-the-token"}, by_host):
        refused = httpx.post(f"{url}/execute", json=cell, headers=headers, timeout=10)
        assert refused.status_code == 401, refused.text
        assert "X-Access-Token" in refused.text
    # A caller cannot vouch for itself: the node removes the mark it sets.
    forged = {**by_headers, "E2b-Access-Token-Verified": "true"}
    refused = httpx.post(f"{url}/execute", json=cell, headers=forged, timeout=10)
    assert refused.status_code == 401, refused.text
    assert sbx.run_code("import os\nos.path.exists('/tmp/pwned')").text == "False"
    # Its health is public, as E2B's is.
    assert httpx.get(f"{url}/health", headers=by_headers, timeout=10).status_code == 200
