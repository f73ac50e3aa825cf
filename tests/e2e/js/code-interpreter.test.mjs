// The official E2B code interpreter SDK for JS (npm `@e2b/code-interpreter`, pinned in
// package.json) against the local stack's own `code-interpreter-v1`, with only E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY set. Run by tests/e2e/test_js_sdk.py with `node --test`.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

test('code runs in kernels that keep their state, with the JS SDK', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    // State between calls and the last expression as the main result.
    await sbx.runCode('x = 40')
    const sum = await sbx.runCode('x + 2')
    assert.equal(sum.text, '42')
    assert.equal(sum.results.length, 1)
    assert.ok(sum.results[0].isMainResult)

    // A figure comes back as PNG, a DataFrame as HTML beside its text.
    const figure = await sbx.runCode(
      'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()',
    )
    assert.ok(figure.results.some((r) => r.png && Buffer.from(r.png, 'base64').subarray(1, 4).toString() === 'PNG'))
    // ... with its data as a chart beside the picture.
    const chart = figure.results.find((r) => r.chart).chart
    assert.equal(chart.type, 'line')
    assert.deepEqual(chart.elements[0].points, [[0, 1], [1, 2], [2, 3]])
    const frame = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert.match(frame.results[0].html, /<table/)
    assert.match(frame.text, /a/)

    // Output streams while the cell runs: the first line arrives before the cell ends.
    const seen = []
    const started = Date.now()
    let firstAt
    const streamed = await sbx.runCode(
      "import time, sys\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')\nprint('oops', file=sys.stderr)",
      {
        onStdout: (m) => {
          firstAt ??= Date.now() - started
          seen.push(m.line)
        },
      },
    )
    assert.ok(firstAt < 1200, `first line after ${firstAt} ms: not streamed`)
    assert.deepEqual(seen.map((l) => l.trim()), ['first', 'second'])
    assert.deepEqual(streamed.logs.stderr.map((l) => l.trim()), ['oops'])

    // Errors carry name, value and traceback; the kernel survives them.
    let reported
    const failed = await sbx.runCode('1 / 0', { onError: (e) => (reported = e) })
    assert.equal(failed.error.name, 'ZeroDivisionError')
    assert.match(failed.error.value, /division by zero/)
    assert.match(failed.error.traceback, /ZeroDivisionError/)
    assert.equal(reported.name, 'ZeroDivisionError')
    assert.equal((await sbx.runCode('x')).text, '40')

    // Per-call env vars.
    const env = await sbx.runCode("import os\nos.environ.get('FROM_JS')", { envs: { FROM_JS: 'yes' } })
    assert.equal(env.text, "'yes'")

    // A timeout interrupts the kernel and leaves the context usable.
    await assert.rejects(sbx.runCode('import time\ntime.sleep(30)', { timeoutMs: 1_000 }))
    assert.equal((await sbx.runCode('x + 1')).text, '41')

    // Contexts: their own state and cwd, listed, restarted, removed.
    const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
    assert.equal((await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text, "'/tmp'")
    await sbx.runCode('y = 7', { context: ctx })
    assert.equal((await sbx.runCode("'y' in dir()")).text, 'False')
    assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode("'y' in dir()", { context: ctx })).text, 'False')
    await sbx.removeCodeContext(ctx)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))

    // Bash, with its own state between calls.
    await sbx.runCode('GREETING=hi; cd /tmp', { language: 'bash' })
    const bash = await sbx.runCode('echo "$GREETING from $(pwd)"', { language: 'bash' })
    assert.deepEqual(bash.logs.stdout, ['hi from /tmp\n'])

    // JavaScript, in a Node.js process of its own that keeps what cells declare.
    await sbx.runCode('const fromJs = [1, 2, 3]', { language: 'javascript' })
    const js = await sbx.runCode('fromJs.map((n) => n * 2)', { language: 'javascript' })
    assert.equal(js.text, '[ 2, 4, 6 ]')

    // Files written by code, read through the files API.
    await sbx.runCode("open('/home/user/from-kernel.txt', 'w').write('kernel wrote this')")
    assert.equal(await sbx.files.read('/home/user/from-kernel.txt'), 'kernel wrote this')
  } finally {
    await sbx.kill()
  }
})

test('a language no kernel speaks is refused clearly', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000 })
  try {
    // (This SDK shows the status, not the server's reason; the Python test reads the reason.)
    await assert.rejects(sbx.runCode('1', { language: 'r' }), /400/)
    await assert.rejects(sbx.runCode('1', { language: 'typescript' }), /400/)
  } finally {
    await sbx.kill()
  }
})
