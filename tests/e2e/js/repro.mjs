import { Sandbox } from 'e2b'
for (let i = 0; i < 10; i++) {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  try {
    await sbx.commands.run('echo hello from js; id -u')
    await sbx.commands.run('exit 3').catch(() => {})
    await sbx.commands.run('id -u', { user: 'root' })
    await sbx.files.write('/tmp/js.txt', 'written by js')
    await sbx.kill()
  } catch (e) {
    console.log('FAILED', sbx.sandboxId, String(e).slice(0, 200))
  }
}
