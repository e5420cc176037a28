// 20 training steps of tiny.toml on the shipped Shakespeare corpus: the browser's losses
// equal the native CLI's (`doppler train --json`) within 1e-4 relative, and its weights
// come out as a SafeTensors file with the native checkpoint's tensors.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { api, dopplerBin, REPO, withBrowser } from './helpers.js';

const CONFIG = readFileSync(new URL('./tiny.toml', import.meta.url), 'utf8');
const REL = 1e-4;

/** The SafeTensors header: {name: {dtype, shape, data_offsets}}. */
function safetensorsHeader(bytes) {
  const buf = Buffer.from(bytes.buffer ?? bytes, bytes.byteOffset ?? 0, bytes.byteLength ?? bytes.length);
  const n = Number(buf.readBigUInt64LE(0));
  const h = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
  delete h.__metadata__;
  return { header: h, data: buf.subarray(8 + n) };
}

function tensor({ header, data }, name) {
  const [a, b] = header[name].data_offsets;
  assert.equal(header[name].dtype, 'F32');
  return new Float32Array(data.buffer.slice(data.byteOffset + a, data.byteOffset + b));
}

async function native(dir) {
  const bin = dopplerBin();
  assert.ok(existsSync(bin), `${bin} is missing: cargo build --release -p doppler-cli, or set DOPPLER_BIN`);
  const corpus = join(REPO, 'data/corpus/shakespeare.txt');
  const cfg = CONFIG
    .replace(/^corpus = .*$/m, `corpus = ${JSON.stringify(corpus)}`)
    .replace(/^out_dir = .*$/m, `out_dir = ${JSON.stringify(join(dir, 'run'))}`);
  writeFileSync(join(dir, 'tiny.toml'), cfg);
  const t0 = Date.now();
  const { stdout } = await promisify(execFile)(bin, ['train', '--config', join(dir, 'tiny.toml'), '--json'],
    { cwd: dir, maxBuffer: 1 << 24 });
  console.log(`native: ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  const events = stdout.split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l));
  const done = events.find((e) => e.event === 'done');
  assert.ok(done, `no "done" event from doppler train --json:\n${stdout}`);
  return {
    steps: events.filter((e) => e.event === 'step').map((e) => [e.step.step, e.step.loss]),
    evals: events.filter((e) => e.event === 'eval').map((e) => [e.step, e.val_loss]),
    start: events.find((e) => e.event === 'start'),
    weights: readFileSync(join(done.summary.checkpoint, 'model.safetensors')),
  };
}

function close(what, got, want) {
  const rel = Math.abs(got - want) / Math.max(Math.abs(want), 1e-12);
  assert.ok(rel <= REL, `${what}: browser ${got}, native ${want} (relative difference ${rel.toExponential(2)} > ${REL})`);
  return rel;
}

test('training tiny.toml: per-step losses equal the native run within 1e-4 relative', async (t) => {
  const dir = mkdtempSync(join(tmpdir(), 'doppler-train-'));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const want = native(dir); // runs while the browser trains
  want.catch(() => {});
  await withBrowser(t, async ({ page }) => {
    const got = await api(page, async (d, config) => {
      const corpus = await (await fetch('/data/corpus/shakespeare.txt')).text();
      const steps = [], evals = [];
      let start = null;
      const t0 = performance.now();
      const run = await d.train(config, corpus, {
        onStart: (e) => { start = e; },
        onStep: (e) => steps.push([e.step, e.loss]),
        onEval: (e) => evals.push([e.step, e.valLoss]),
      });
      const seconds = (performance.now() - t0) / 1000;
      const weights = Array.from(await run.safetensors());
      const s = run.sample('ROMEO:', { maxTokens: 16, temperature: 0 });
      let pieces = '';
      for await (const p of s) pieces += p;
      const sample = (await s.result).text;
      const tokenizer = JSON.parse(run.tokenizerJson());
      run.dispose();
      return { steps, evals, start, seconds, summary: run.summary, weights, sample, pieces, tokenizerKeys: Object.keys(tokenizer) };
    }, CONFIG);
    console.log(`browser: ${got.seconds.toFixed(1)} s for ${got.steps.length} steps; ` +
      `sample ${JSON.stringify(got.sample)}; summary ${JSON.stringify(got.summary)}`);
    const n = await want;
    assert.equal(got.start.params, n.start.params, 'parameter count');
    assert.equal(got.start.outputs, n.start.vocab, 'vocabulary');
    assert.equal(got.start.trainItems, n.start.train_tokens);
    assert.equal(got.steps.length, 20);
    assert.deepEqual(got.steps.map((s) => s[0]), n.steps.map((s) => s[0]), 'step numbers');
    let worst = 0;
    for (const [i, [step, loss]] of got.steps.entries()) worst = Math.max(worst, close(`step ${step} loss`, loss, n.steps[i][1]));
    assert.deepEqual(got.evals.map((e) => e[0]), n.evals.map((e) => e[0]), 'evaluation steps');
    for (const [i, [step, v]] of got.evals.entries()) worst = Math.max(worst, close(`step ${step} validation loss`, v, n.evals[i][1]));
    console.log(`losses: ${got.steps.map((s) => s[1].toFixed(4)).join(' ')}; validation ${got.evals.map((e) => e[1].toFixed(4)).join(' ')}; ` +
      `worst relative difference from native ${worst.toExponential(2)}`);

    // The weights: the native checkpoint's tensors, with nearly the same values.
    const mine = safetensorsHeader(new Uint8Array(got.weights));
    const theirs = safetensorsHeader(n.weights);
    assert.deepEqual(Object.keys(mine.header).sort(), Object.keys(theirs.header).sort(), 'tensor names');
    let maxDiff = 0;
    for (const name of Object.keys(theirs.header)) {
      assert.deepEqual(mine.header[name].shape, theirs.header[name].shape, `${name} shape`);
      const a = tensor(mine, name), b = tensor(theirs, name);
      for (let i = 0; i < a.length; i++) maxDiff = Math.max(maxDiff, Math.abs(a[i] - b[i]));
    }
    console.log(`weights: ${Object.keys(mine.header).length} tensors, largest difference from native ${maxDiff.toExponential(2)}`);
    assert.ok(maxDiff < 1e-3, `weights differ from the native run's by ${maxDiff}`);
    assert.ok(got.sample.length > 0, 'the trained model samples some text');
    assert.equal(got.pieces, got.sample);
    assert.ok(got.tokenizerKeys.length > 0);

    // Stopped after step 3 (the run kept: the same first losses, and it samples), then
    // abandoned at step 2 (rejected).
    const early = await api(page, async (d, config) => {
      const corpus = await (await fetch('/data/corpus/shakespeare.txt')).text();
      const stop = new AbortController();
      const steps = [];
      const run = await d.train(config, corpus, {
        stop: stop.signal,
        onStep: (e) => { steps.push([e.step, e.loss]); if (e.step === 3) stop.abort(); },
      });
      const weights = (await run.safetensors()).length;
      const s = run.sample('ROMEO:', { maxTokens: 4, temperature: 0 });
      const sample = (await s.result).text;
      run.dispose();
      const abort = new AbortController();
      let aborted = null;
      try {
        await d.train(config, corpus, { signal: abort.signal, onStep: (e) => { if (e.step === 2) abort.abort(); } });
      } catch (e) { aborted = String(e.message ?? e); }
      return { steps, summary: run.summary, weights, sample, aborted, live: d.poolStats().live_bytes };
    }, CONFIG);
    console.log(`stopped: ${JSON.stringify(early.summary)}; abandoned: ${early.aborted}`);
    assert.equal(early.summary.stopped, true);
    assert.equal(early.summary.steps, 3);
    assert.deepEqual(early.steps.map((s) => s[0]), [1, 2, 3]);
    for (const [i, [step, loss]] of early.steps.entries()) close(`stopped run, step ${step} loss`, loss, n.steps[i][1]);
    assert.ok(Number.isFinite(early.summary.finalValLoss), 'validation taken at the stop');
    assert.ok(early.weights > 0 && early.sample.length > 0);
    assert.match(early.aborted ?? '', /train: aborted/);
    assert.equal(early.live, 0, 'GPU memory held after the runs');
  });
});
