// Runs the browser build (web/pkg) outside a browser: Node with Dawn's WebGPU (npm
// `webgpu`, dawn.node) on the machine's Vulkan driver, for figures on a GPU machine that
// has no browser. Greedy decode of a GGUF model through the same JS API as the page.
//   node bench/web_node.mjs MODEL.gguf [--prompt TEXT] [--gen N] [--webgpu DIR]
// DIR: where the `webgpu` package is (default: resolved by Node).
import { readFileSync } from 'node:fs';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { dirname, join, resolve } from 'node:path';

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? args.splice(i, 2)[1] : dflt;
};
const prompt = opt('--prompt', 'The capital of France is');
const gen = Number(opt('--gen', '128'));
const webgpuDir = opt('--webgpu', null);
const runs = Number(opt('--runs', '3'));
const filter = opt('--verify', null);
const model = args[0];

const { create, globals } = await import(webgpuDir ? pathToFileURL(join(resolve(webgpuDir), 'index.js')).href : 'webgpu');
Object.assign(globalThis, globals);
globalThis.navigator = { gpu: create(['backend=vulkan']) };
// wgpu looks for navigator.gpu on a window (or a worker): present this context as one.
globalThis.Window ??= class Window {};

const pkg = join(dirname(fileURLToPath(import.meta.url)), '..', 'web', 'pkg');
const glue = await import(pathToFileURL(join(pkg, 'doppler_web.js')).href);
await glue.default({ module_or_path: readFileSync(join(pkg, 'doppler_web_bg.wasm')) });
const doppler = await import(pathToFileURL(join(pkg, 'doppler.js')).href);

const info = await doppler.init();
const out = { adapter: info.name, backend: info.backend, paths: info.paths };
if (filter) {
  const v = await doppler.verify({ filter });
  out.verify = { checks: v.checks.length, failed: v.failed, failures: v.checks.filter((c) => !c.pass) };
}
if (model) {
  const t0 = performance.now();
  const m = await doppler.loadModel(readFileSync(model), { maxContext: 1024 });
  out.load_ms = performance.now() - t0;
  out.runs = [];
  for (let i = 0; i < runs; i++) {
    const s = m.generate(prompt, { maxTokens: gen, temperature: 0 });
    for await (const _ of s) { /* streamed */ }
    const r = await s.result;
    out.runs.push({ tokens: r.tokens.length, prefill_ms: r.prefillMs, decode_tok_s: r.decodeTokS });
    out.first_ids ??= r.tokens.slice(0, 8);
  }
  // The first run compiles the pipelines: the median is over the others.
  const d = out.runs.slice(1).map((r) => r.decode_tok_s).sort((a, b) => a - b);
  out.decode_tok_s_median = d.length % 2 ? d[(d.length - 1) / 2] : (d[d.length / 2 - 1] + d[d.length / 2]) / 2;
}
console.log(JSON.stringify(out));
process.exit(0);
