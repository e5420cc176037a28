// Bad input and clean-up: files that are not models, a truncated GGUF, bad options, an
// aborted generation, and GPU memory given back by dispose(). After each failure the API
// still works. (SwiftShader takes ~30 s a token: the generations here are one token long.)
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { api, MODEL_NAME, withBrowser } from './helpers.js';

test('bad input rejects with a clear message; abort; dispose gives GPU memory back', async (t) => {
  await withBrowser(t, async ({ page }) => {
    const r = await api(page, async (d, url) => {
      const out = {};
      const rejects = async (what, f) => {
        const t0 = performance.now();
        try {
          await f();
          out[what] = { ok: true };
        } catch (e) {
          out[what] = { ok: false, message: e instanceof Error ? e.message : String(e), isError: e instanceof Error };
        }
        out[what].s = +((performance.now() - t0) / 1000).toFixed(2);
      };
      await d.init();
      const baseline = d.poolStats().live_bytes;
      out.baseline = baseline;

      // Not a model: random bytes, a TOML file, nothing; a missing URL; not a source.
      const random = crypto.getRandomValues(new Uint8Array(65536));
      await rejects('random', () => d.loadModel(random.buffer));
      const toml = await (await fetch('/configs/default.toml')).text();
      await rejects('toml', () => d.loadModel(new File([toml], 'default.toml', { type: 'text/plain' })));
      await rejects('empty', () => d.loadModel(new ArrayBuffer(0)));
      await rejects('missing URL', () => d.loadModel('/models/no-such-model.gguf', { cache: false }));
      await rejects('not a source', () => d.loadModel(42));
      // The model's first megabyte.
      const bytes = await (await fetch(url)).arrayBuffer();
      await rejects('truncated', () => d.loadModel(bytes.slice(0, 1 << 20)));
      out.afterBad = d.poolStats().live_bytes;

      // Load and dispose five times: the live bytes return to the baseline every time.
      out.cycles = [];
      for (let i = 0; i < 5; i++) {
        const t0 = performance.now();
        const m = await d.loadModel(bytes, { maxContext: 64 });
        const loaded = d.poolStats().live_bytes;
        m.dispose();
        out.cycles.push({ loaded, after: d.poolStats().live_bytes, s: +((performance.now() - t0) / 1000).toFixed(2) });
      }

      const model = await d.loadModel(bytes, { maxContext: 64 });
      out.loaded = d.poolStats().live_bytes;
      // Bad options are refused before any GPU work.
      await rejects('bad option', () => model.generate('x', { topP: 0 }).result);
      await rejects('unknown option', () => model.generate('x', { max_tokens: 3 }).result);
      // An aborted generation rejects with "generate: aborted", through the iterator too.
      const s = model.generate('The capital of France is', { maxTokens: 20, temperature: 0 });
      s.abort();
      let pieces = 0;
      try {
        for await (const _ of s) pieces++;
        out.iterator = { ok: true };
      } catch (e) {
        out.iterator = { ok: false, message: e.message };
      }
      await rejects('aborted', () => s.result);
      out.abortedPieces = pieces;
      // Then the model generates again (one token), and refuses a second generation meanwhile.
      const again = model.generate('The capital of France is', { maxTokens: 1, temperature: 0 });
      await rejects('busy', () => model.generate('x', { maxTokens: 1 }).result);
      const g = await again.result;
      out.again = { tokens: g.tokens, text: g.text };
      out.afterGenerate = d.poolStats();
      model.dispose();
      await rejects('after dispose', () => model.generate('x').result);
      out.final = d.poolStats().live_bytes;
      out.init = (await d.init()).backend;
      return out;
    }, `/models/${MODEL_NAME}`);

    for (const [k, v] of Object.entries(r)) console.log(`${k}: ${JSON.stringify(v)}`);
    for (const k of ['random', 'toml', 'empty', 'truncated']) {
      assert.equal(r[k].ok, false, `loadModel(${k}) resolved`);
      assert.ok(r[k].isError, `${k}: rejected with an Error`);
      assert.match(r[k].message, /gguf|truncated|magic|not a model/i, `${k}: ${r[k].message}`);
    }
    assert.match(r.truncated.message, /truncated|corrupt/);
    assert.match(r['missing URL'].message, /HTTP 404/);
    assert.match(r['not a source'].message, /expected a URL/);
    assert.equal(r.afterBad, r.baseline, 'failed loads leave no GPU buffers behind');
    for (const [i, c] of r.cycles.entries()) {
      assert.ok(c.loaded > r.baseline, `cycle ${i}: the model holds GPU memory`);
      assert.equal(c.after, r.baseline, `cycle ${i}: live bytes after dispose ${c.after}, baseline ${r.baseline}`);
    }
    assert.match(r['bad option'].message, /top-p/);
    assert.match(r['unknown option'].message, /unknown field `max_tokens`/);
    assert.equal(r.iterator.ok, false);
    assert.match(r.iterator.message, /generate: aborted/);
    assert.equal(r.aborted.ok, false);
    assert.match(r.aborted.message, /generate: aborted/);
    assert.equal(r.abortedPieces, 0);
    assert.match(r.busy.message, /a generation is running/);
    assert.deepEqual(r.again.tokens, [7042], 'greedy: " Paris"');
    assert.match(r['after dispose'].message, /after dispose/);
    assert.equal(r.final, r.baseline, 'every buffer is given back after the last dispose');
    assert.equal(r.init, 'BrowserWebGpu');
  });
});
