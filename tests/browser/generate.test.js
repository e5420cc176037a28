// SmolLM2-135M-Instruct, greedy: the browser's token ids equal the native CLI's
// (`doppler generate --json`) for a fixed prompt, after loading the model by URL three
// ways (into the OPFS cache and read back a tensor at a time, from the cache, into
// memory); the loads from the cache never hold the whole file in WebAssembly memory.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, statSync } from 'node:fs';
import { promisify } from 'node:util';
import { api, dopplerBin, modelPath, MODEL_NAME, REPO, withBrowser } from './helpers.js';

const PROMPT = 'The capital of France is';
const TOKENS = 8;

async function native() {
  const bin = dopplerBin();
  assert.ok(existsSync(bin), `${bin} is missing: cargo build --release -p doppler-cli, or set DOPPLER_BIN`);
  const t0 = Date.now();
  const { stdout } = await promisify(execFile)(
    bin, ['generate', '-m', modelPath(), PROMPT, '-n', String(TOKENS), '--temperature', '0', '--json'],
    { cwd: REPO, maxBuffer: 1 << 24 },
  );
  const line = stdout.trim().split('\n').filter((l) => l.startsWith('{')).pop();
  assert.ok(line, `no JSON line from doppler generate --json: ${stdout}`);
  console.log(`native: ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  return JSON.parse(line);
}

test('SmolLM2 greedy generation matches the native CLI token for token', async (t) => {
  assert.ok(existsSync(modelPath()), `${modelPath()} is missing: bash scripts/fetch_model.sh`);
  const want = native(); // runs while the browser loads the model
  want.catch(() => {});
  await withBrowser(t, async ({ page }) => {
    const got = await api(page, async (d, { url, prompt, n }) => {
      // Three ways in: downloaded into the cache and read from it a tensor at a time, read
      // from the cache again (a reload), then downloaded into memory (no cache).
      await d.clearCache();
      const loads = [];
      let m = null;
      let wasmBytes = 0;
      for (const cache of [true, true, false]) {
        const phases = new Set();
        const t0 = performance.now();
        m?.dispose();
        m = await d.loadModel(url, { cache, maxContext: 256, onProgress: (p) => phases.add(p.phase) });
        loads.push({ cache, s: (performance.now() - t0) / 1000, phases: [...phases].sort() });
        if (cache) wasmBytes = d.poolStats().wasm_bytes; // before the load into memory
      }
      const cached = await d.cachedModel(url);
      const s = m.generate(prompt, { chat: false, maxTokens: n, temperature: 0 });
      let streamed = '';
      for await (const piece of s) streamed += piece;
      const r = await s.result;
      m.dispose();
      return { ...r, streamed, loads, cached, wasmBytes, loadS: loads[1].s };
    }, { url: `/models/${MODEL_NAME}`, prompt: PROMPT, n: TOKENS });
    const n = await want;
    console.log(`loads: ${JSON.stringify(got.loads)}`);
    const sha = createHash('sha256').update(readFileSync(modelPath())).digest('hex');
    assert.equal(got.cached?.sha256, sha, 'the cache holds the file under its SHA-256');
    assert.deepEqual(got.loads.map((l) => l.phases), [
      ['download', 'upload'], ['cache', 'upload'], ['download', 'upload'],
    ], 'the first load downloads into the cache, the second reads it back');
    const size = statSync(modelPath()).size;
    console.log(`WebAssembly memory after the loads from the cache: ${got.wasmBytes} bytes (the file: ${size})`);
    assert.ok(got.wasmBytes < size, `the file went whole into WebAssembly memory (${got.wasmBytes} bytes)`);
    console.log(`browser: load ${got.loadS.toFixed(1)} s, prefill ${got.prefillMs.toFixed(0)} ms ` +
      `(${got.prefillTokS.toFixed(1)} tok/s), decode ${got.decodeTokS.toFixed(2)} tok/s; ` +
      `text ${JSON.stringify(got.text)} tokens ${JSON.stringify(got.tokens)}`);
    console.log(`native:  text ${JSON.stringify(n.text)} tokens ${JSON.stringify(n.tokens)}`);
    assert.equal(got.promptTokens, n.prompt_tokens, 'prompt token count');
    assert.deepEqual(got.tokens, n.tokens, 'generated token ids');
    assert.equal(got.text, n.text);
    assert.equal(got.streamed, got.text, 'the streamed pieces add up to the text');
    assert.equal(got.tokens.length, TOKENS);
  });
});
