// A JavaScript context of the code interpreter: one long-lived Node.js process, started by
// server.py, that runs each cell it is sent in this process's own global scope, so what a cell
// declares (`var`, `let`, `const`, functions) the next cells see, as consecutive <script>s of
// one page do.
//
// The protocol with server.py: a request is one JSON line on stdin, `{id, code, env}`; every
// event goes to stdout as one line, the token from E2B_JS_EVENTS_TOKEN followed by a JSON
// object — `stdout`/`stderr` `{text}`, `result` `{text, is_main_result}`, `error` `{name,
// value, traceback}` and last `done` `{id}`. Anything else on stdout (a child process that
// inherited it) is the cell's output as it stands.
//
// A cell's last expression is its result. A cell that uses `await` at its top level runs as
// an async function (what Node's REPL does too): its simple top-level declarations
// (`const x = ...` at the start of a line) become globals so later cells see them, and its
// last line, when it is an expression, is its result. SIGINT interrupts a cell: a synchronous
// one where it stands, an awaiting one by giving up on what it awaits.

'use strict'

const vm = require('node:vm')
const util = require('node:util')
const readline = require('node:readline')

const TOKEN = process.env.E2B_JS_EVENTS_TOKEN || ''
delete process.env.E2B_JS_EVENTS_TOKEN
const channel = process.stdout.write.bind(process.stdout)
const send = (event) => channel(TOKEN + JSON.stringify(event) + '\n')

// What the cell prints (console.* write through these) becomes events of the cell.
for (const [name, stream] of [['stdout', process.stdout], ['stderr', process.stderr]]) {
  stream.write = (chunk, encoding, done) => {
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8')
    if (text) send({ type: name, text })
    const callback = typeof encoding === 'function' ? encoding : done
    if (callback) process.nextTick(callback)
    return true
  }
}

// Cells see `require` as a CommonJS module does, resolved from the context's directory.
globalThis.require = require

let interrupt = () => {}
process.on('SIGINT', () => interrupt())

const AWAIT_ONLY_IN_ASYNC = /await is only valid|Unexpected reserved word/

/** The script for a cell with top-level `await`: an async function returning its last line. */
function asyncScript(code) {
  const globalised = code.replace(/^(?:const|let|var)\s+([A-Za-z_$][\w$]*)\s*=/gm, '$1 =')
  const lines = globalised.trimEnd().split('\n')
  const last = lines.pop()
  try {
    return new vm.Script(`(async () => {\n${lines.join('\n')}\nreturn (${last}\n)\n})()`, { filename: 'cell.js' })
  } catch {
    return new vm.Script(`(async () => {\n${globalised}\n})()`, { filename: 'cell.js' })
  }
}

async function evaluate(code) {
  let script
  let awaited = false
  try {
    script = new vm.Script(code, { filename: 'cell.js' })
  } catch (error) {
    if (!(error instanceof SyntaxError) || !AWAIT_ONLY_IN_ASYNC.test(error.message)) throw error
    script = asyncScript(code)
    awaited = true
  }
  const value = script.runInThisContext({ breakOnSigint: true, displayErrors: false })
  if (!awaited) return value
  return await new Promise((resolve, reject) => {
    interrupt = () => reject(new Error('Script execution was interrupted by `SIGINT`'))
    value.then(resolve, reject)
  })
}

/** The stack of `error` down to the cell's own frames (not this driver's, nor node:vm's). */
function cellStack(error) {
  const frames = error.stack.split('\n')
  const cut = frames.findIndex((frame) => frame.includes('node:vm') || frame.includes(__filename))
  return (cut > 0 ? frames.slice(0, cut) : frames).join('\n')
}

async function run({ id, code, env }) {
  const saved = {}
  for (const [key, value] of Object.entries(env || {})) {
    saved[key] = process.env[key]
    process.env[key] = value
  }
  try {
    const value = await evaluate(code)
    if (value !== undefined) send({ type: 'result', is_main_result: true, text: util.inspect(value) })
  } catch (error) {
    const isError = error instanceof Error
    send({
      type: 'error',
      name: isError ? error.name : 'Error',
      value: isError ? error.message : util.inspect(error),
      traceback: isError && error.stack ? cellStack(error) : util.inspect(error),
    })
  } finally {
    interrupt = () => {}
    for (const [key, value] of Object.entries(saved)) {
      if (value === undefined) delete process.env[key]
      else process.env[key] = value
    }
    send({ type: 'done', id })
  }
}

// One cell at a time, in the order they come.
let queue = Promise.resolve()
readline.createInterface({ input: process.stdin }).on('line', (line) => {
  const request = JSON.parse(line)
  queue = queue.then(() => run(request))
})
