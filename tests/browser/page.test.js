// The demo page (web/index.html) driven as a person would: the adapter tab, an error shown
// in the page, loading SmolLM2 by URL, a chat reply streamed into the page (screenshot in
// tests/browser/out/); training with the loss curve, sampling and the weights' download;
// the digits classifier with its accuracy curve; the Verify tab; and the message without
// WebGPU.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { OUT, withBrowser } from './helpers.js';

const MINUTES = 60_000;

test('demo page: load SmolLM2 by URL, chat, the reply streams into the page', async (t) => {
  mkdirSync(OUT, { recursive: true });
  await withBrowser(t, { path: '/index.html' }, async ({ page }) => {
    // Adapter tab (the default): the report.
    await page.waitForFunction(() => /WebGPU ready/.test(document.getElementById('status').textContent), null, { timeout: MINUTES });
    const summary = await page.textContent('#adapter-summary');
    assert.match(summary, /BrowserWebGpu/);
    assert.match(summary, /attention \(head dim 64\)\s*(rows|tiled|coop)/);
    assert.ok(await page.locator('#adapter-limits tr').count() > 3);

    // Chat tab: a URL that does not exist shows its error in the page.
    await page.click('#tab-chat');
    assert.equal(await page.isVisible('#panel-chat'), true);
    assert.equal(await page.inputValue('#model-url'), 'models/SmolLM2-135M-Instruct.Q4_1.gguf');
    await page.fill('#model-url', 'models/missing.gguf');
    await page.click('#model-load-url');
    await page.waitForSelector('#error:not([hidden])', { timeout: MINUTES });
    assert.match(await page.textContent('#error'), /HTTP 404/);
    assert.equal(await page.isEnabled('#model-load-url'), true, 'the page stays usable');
    // A file that is not a model, through the file picker.
    await page.setInputFiles('#model-file', { name: 'notes.gguf', mimeType: 'application/octet-stream', buffer: Buffer.from('plain text, not a model') });
    await page.waitForFunction(() => /notes\.gguf/.test(document.getElementById('error-where').textContent), null, { timeout: MINUTES });
    assert.match(await page.textContent('#error-text'), /not a GGUF file/);
    assert.equal(await page.textContent('#model-info'), 'No model loaded.');

    // The real model, by the default URL, with the progress bar.
    await page.fill('#model-url', 'models/SmolLM2-135M-Instruct.Q4_1.gguf');
    const t0 = Date.now();
    await page.click('#model-load-url');
    await page.waitForSelector('#error', { state: 'hidden' });
    await page.waitForFunction(() => /layers/.test(document.getElementById('model-info').textContent), null, { timeout: 5 * MINUTES });
    console.log(`model loaded in ${((Date.now() - t0) / 1000).toFixed(1)} s: ${await page.textContent('#model-info')}`);
    assert.equal(await page.getAttribute('#model-progress', 'value'), '1');
    assert.equal(await page.inputValue('#chat-mode'), 'chat');

    // A message; the reply streams in.
    await page.fill('#chat-max-tokens', '3'); // ~30 s a token on SwiftShader
    await page.fill('#chat-temperature', '0');
    await page.fill('#chat-input', 'What is the capital of France?');
    const t1 = Date.now();
    await page.click('#chat-send');
    await page.waitForFunction(() => {
      const m = document.querySelector('#chat-log .msg.assistant .text');
      return m && m.textContent.length > 0;
    }, null, { timeout: 5 * MINUTES });
    const firstPiece = (Date.now() - t1) / 1000;
    await page.waitForSelector('#chat-log .msg.assistant[data-done]', { timeout: 5 * MINUTES });
    const reply = await page.textContent('#chat-log .msg.assistant .text');
    const stats = await page.textContent('#chat-stats');
    console.log(`reply after ${((Date.now() - t1) / 1000).toFixed(1)} s (first piece ${firstPiece.toFixed(1)} s): ${JSON.stringify(reply)}; ${stats}`);
    assert.equal(await page.getAttribute('#chat-log .msg.assistant', 'data-done'), 'true');
    assert.ok(reply.trim().length > 0, 'the reply is not empty');
    assert.match(stats, /prefill [\d.]+ tok\/s/);
    assert.match(stats, /decode [\d.]+ tok\/s/);
    assert.equal(await page.isVisible('#error'), false);
    const png = join(OUT, 'chat.png');
    await page.screenshot({ path: png, fullPage: true });
    const size = statSync(png).size;
    console.log(`screenshot ${png}: ${size} bytes`);
    assert.ok(size > 20_000, `the screenshot is ${size} bytes`);

    // Reset clears the conversation.
    await page.click('#chat-reset');
    assert.equal(await page.locator('#chat-log .msg').count(), 0);

    // Train tab: the default config, fetched from configs/.
    await page.click('#tab-train');
    await page.waitForFunction(() => document.getElementById('train-config').value.includes('[model]'), null, { timeout: MINUTES });
    assert.match(await page.inputValue('#train-config'), /shakespeare/);
  });
});

test('demo page: train a tiny model with the loss curve, sample, download; verify', async (t) => {
  mkdirSync(OUT, { recursive: true });
  const tiny = readFileSync(new URL('./tiny.toml', import.meta.url), 'utf8');
  await withBrowser(t, { path: '/index.html#train' }, async ({ page }) => {
    await page.waitForFunction(() => /WebGPU ready/.test(document.getElementById('status').textContent), null, { timeout: MINUTES });
    assert.equal(await page.isVisible('#panel-train'), true, '#train opens the Train tab');
    await page.waitForFunction(() => document.getElementById('train-config').value.includes('[model]'), null, { timeout: MINUTES });
    await page.fill('#train-config', tiny);
    await page.fill('#train-max-steps', '6');
    const t0 = Date.now();
    await page.click('#train-start');
    await page.waitForSelector('#train-summary[data-done]', { timeout: 5 * MINUTES });
    const summary = await page.textContent('#train-summary');
    console.log(`trained in ${((Date.now() - t0) / 1000).toFixed(1)} s: ${summary} ${await page.textContent('#train-status')}`);
    assert.equal(await page.getAttribute('#train-summary', 'data-done'), 'true', summary);
    assert.match(summary, /Done: 6 steps/);
    const points = (sel) => page.$eval(sel, (e) => e.getAttribute('points').trim().split(/\s+/).filter(Boolean).length);
    assert.equal(await points('#train-line'), 6, 'a point a step');
    assert.ok(await points('#val-line') >= 1, 'validation points');
    // The weights link: a SafeTensors file.
    await page.waitForSelector('#train-download:not(.disabled)');
    const st = await page.$eval('#train-download', async (a) => {
      const b = new Uint8Array(await (await fetch(a.href)).arrayBuffer());
      const n = Number(new DataView(b.buffer).getBigUint64(0, true));
      return { size: b.length, download: a.download, names: Object.keys(JSON.parse(new TextDecoder().decode(b.subarray(8, 8 + n)))) };
    });
    console.log(`download ${st.download}: ${st.size} bytes, tensors ${st.names.join(' ')}`);
    assert.equal(st.download, 'model.safetensors');
    assert.ok(st.names.length > 3 && st.size > 15072 * 4);
    // Sample from it.
    await page.fill('#train-sample-tokens', '24');
    await page.click('#train-sample');
    await page.waitForSelector('#train-sample-out[data-done]', { timeout: 2 * MINUTES });
    const sample = await page.textContent('#train-sample-out');
    console.log(`sample: ${JSON.stringify(sample)}`);
    assert.ok(sample.startsWith('ROMEO:') && sample.length > 'ROMEO:'.length);
    await page.screenshot({ path: join(OUT, 'train.png'), fullPage: true });

    // Stop: a second run stopped after a step, kept.
    await page.fill('#train-max-steps', '');
    await page.click('#train-start');
    await page.waitForFunction(() => /^step \d/.test(document.getElementById('train-status').textContent), null, { timeout: 2 * MINUTES });
    await page.click('#train-stop');
    await page.waitForSelector('#train-summary[data-done]', { timeout: 2 * MINUTES });
    assert.equal(await page.getAttribute('#train-summary', 'data-done'), 'stopped', await page.textContent('#train-summary'));
    assert.match(await page.textContent('#train-summary'), /^Stopped: \d+ steps/);
    assert.equal(await page.isEnabled('#train-sample'), true, 'a stopped run is kept: it samples');
    assert.equal(await page.isVisible('#error'), false);
    assert.equal(await page.isEnabled('#train-start'), true);

    // Verify tab: a small family, a row per check.
    await page.click('#tab-verify');
    await page.fill('#verify-filter', 'adamw');
    await page.click('#verify-run');
    await page.waitForSelector('#verify-summary[data-done]', { timeout: 3 * MINUTES });
    console.log(`verify tab: ${await page.textContent('#verify-summary')}`);
    assert.equal(await page.getAttribute('#verify-summary', 'data-done'), 'pass');
    assert.ok(await page.locator('#verify-table tbody tr.pass').count() > 0);
    assert.equal(await page.locator('#verify-table tbody tr.fail').count(), 0);
  });
});

test('demo page: the digits classifier trains with live loss and accuracy curves', async (t) => {
  mkdirSync(OUT, { recursive: true });
  await withBrowser(t, { path: '/index.html#train' }, async ({ page }) => {
    await page.waitForFunction(() => /WebGPU ready/.test(document.getElementById('status').textContent), null, { timeout: MINUTES });
    await page.waitForFunction(() => document.getElementById('train-config').value.includes('[model]'), null, { timeout: MINUTES });
    await page.selectOption('#train-task', 'digits');
    await page.waitForFunction(() => document.getElementById('train-config').value.includes('arch = "convnet"'), null, { timeout: MINUTES });
    assert.match(await page.textContent('#train-corpus-name'), /digits\.csv/);
    // 8 steps with an evaluation every 4: the accuracy curve has points at 0, 4 and 8.
    // Batches of 16 and 36 held-out images: SwiftShader runs these convolutions at ~10
    // images/s.
    const cfg = (await page.inputValue('#train-config'))
      .replace(/^eval_interval = .*$/m, 'eval_interval = 4')
      .replace(/^batch_size = .*$/m, 'batch_size = 16')
      .replace(/^val_fraction = .*$/m, 'val_fraction = 0.02');
    await page.fill('#train-config', cfg);
    await page.fill('#train-max-steps', '8');
    const t0 = Date.now();
    await page.click('#train-start');
    await page.waitForFunction(() => /^step \d/.test(document.getElementById('train-status').textContent), null, { timeout: 5 * MINUTES });
    assert.match(await page.textContent('#train-status'), /images\/s/);
    await page.waitForSelector('#train-summary[data-done]', { timeout: 10 * MINUTES });
    const summary = await page.textContent('#train-summary');
    console.log(`digits in the page: ${((Date.now() - t0) / 1000).toFixed(1)} s: ${summary} ${await page.textContent('#train-status')}`);
    assert.equal(await page.getAttribute('#train-summary', 'data-done'), 'true', summary);
    assert.match(summary, /Done: 8 steps .* images\/s.*accuracy \d+\.\d+%/);
    const points = (sel) => page.$eval(sel, (e) => e.getAttribute('points').trim().split(/\s+/).filter(Boolean).length);
    assert.equal(await points('#train-line'), 8, 'a loss point a step');
    assert.equal(await points('#acc-line'), 3, 'accuracy at steps 0, 4 and 8');
    assert.match(await page.textContent('#train-chart'), /validation accuracy/);
    // A classifier has weights to download, no tokenizer and no text to sample.
    await page.waitForSelector('#train-download:not(.disabled)');
    assert.equal(await page.isEnabled('#train-sample'), false);
    assert.equal(await page.getAttribute('#train-download-tokenizer', 'aria-disabled'), 'true');
    assert.equal(await page.isVisible('#error'), false);
    await page.screenshot({ path: join(OUT, 'train-digits.png'), fullPage: true });
  });
});

test('demo page without WebGPU says how to enable it', async (t) => {
  // No adapter (Chromium without --enable-unsafe-webgpu), and no navigator.gpu at all.
  for (const [what, opts] of [
    ['no adapter', { webgpu: false }],
    ['no navigator.gpu', { initScript: () => Object.defineProperty(Navigator.prototype, 'gpu', { get: () => undefined }) }],
  ]) {
    await withBrowser(t, { path: '/index.html', ...opts }, async ({ page }) => {
      await page.waitForSelector('#no-webgpu:not([hidden])', { timeout: MINUTES });
      const text = (await page.textContent('#no-webgpu')).replace(/\s+/g, ' ').trim();
      console.log(`${what}: ${JSON.stringify(text)}`);
      assert.match(text, /WebGPU/);
      assert.match(text, /--enable-unsafe-webgpu/, `the message says how to enable WebGPU: ${text}`);
      assert.match(text, /chrome:\/\/flags/);
      assert.doesNotMatch(text, /backend|wgpu/i, 'no wgpu internals in the message');
      // The tabs still work.
      await page.click('#tab-verify');
      assert.equal(await page.isVisible('#panel-verify'), true);
    });
  }
});
