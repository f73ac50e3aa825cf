// The official E2B JS SDK (npm `e2b`, pinned in package.json) against the local stack, with
// only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set. Run by tests/e2e/test_js_sdk.py
// with `node --test`.

import { test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { Sandbox, CommandExitError } from 'e2b'

/** GET `path` from the gateway with `Host: host`: (status, body). */
function viaHost(host, path, headers = {}) {
  const url = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: url.hostname, port: url.port, path, headers: { host, ...headers } },
      (res) => {
        let body = ''
        res.setEncoding('utf8')
        res.on('data', (chunk) => (body += chunk))
        res.on('end', () => resolve([res.statusCode, body]))
      },
    )
    req.on('error', reject)
    req.end()
  })
}

test('a sandbox through its life with the JS SDK', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { sdk: 'js' } })
  try {
    // Commands: output, exit codes, the user.
    const out = await sbx.commands.run('echo hello from js; id -u')
    assert.equal(out.stdout, 'hello from js\n1000\n')
    await assert.rejects(sbx.commands.run('exit 3'), (err) => err instanceof CommandExitError && err.exitCode === 3)
    const root = await sbx.commands.run('id -u', { user: 'root' })
    assert.equal(root.stdout, '0\n')

    // Files anywhere.
    await sbx.files.write('/tmp/js.txt', 'written by js')
    assert.equal(await sbx.files.read('/tmp/js.txt'), 'written by js')
    const listed = await sbx.files.list('/tmp')
    assert.ok(listed.some((e) => e.name === 'js.txt'))

    // A terminal: what is typed runs, what it prints comes back.
    let seen = ''
    const decoder = new TextDecoder()
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (seen += decoder.decode(d)) })
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((6*7))\nexit\n'))
    await pty.wait().catch(() => {})
    assert.match(seen, /pty-42/)

    // A port: a server in the sandbox answers through the gateway by host name.
    await sbx.files.write('/home/user/index.html', 'served to js')
    await sbx.commands.run('python3 -m http.server 8000 --bind 127.0.0.1', { background: true })
    await sbx.commands.run(
      "for i in $(seq 100); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000))\" 2>/dev/null && exit 0; sleep 0.05; done; exit 1",
    )
    const [status, body] = await viaHost(sbx.getHost(8000), '/index.html')
    assert.equal(status, 200)
    assert.equal(body, 'served to js')

    // Pause, then connect: files kept, running again.
    await sbx.pause()
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 60_000 })
    assert.equal(await back.isRunning(), true)
    assert.equal(await back.files.read('/tmp/js.txt'), 'written by js')
  } finally {
    await sbx.kill()
  }
  assert.equal(await sbx.isRunning(), false)
})
