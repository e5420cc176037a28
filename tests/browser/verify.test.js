// The kernel checks (`doppler verify`) in the browser, one subtest per filter: every check
// passes. SwiftShader compiles each pipeline in 1-2 s and runs wide grids slowly, so this
// is a representative set; the families whose checks take many minutes there run only
// with DOPPLER_BROWSER_SLOW=1.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { api, openBrowser } from './helpers.js';

// [filter, seconds it took on SwiftShader on 2 cores]
const FILTERS = [
  ['matmul (bk', 38], // the f32 matmul family (bk 8 and 16), without the quantized products
  ['cross_entropy', 6],
  ['embedding', 4],
  ['adamw', 6],
  ['rope', 16], // rope, rope_store, qmatmul_rope_store
  ['kv_attend', 19],
  ['attention', 85], // forward, lse, backward; rows path (no shader-f16 there)
];
// Their [70000, 3] cases (more than 65535 rows, one workgroup a row) take minutes there.
const SLOW = [
  ['softmax', 390],
  ['layer_norm', 660], // the norm family: layer_norm and rms_norm, forward and backward
];

test('verify: kernel checks pass in the browser', async (t) => {
  const b = await openBrowser();
  let total = 0, failed = 0;
  t.after(() => b.close());
  try {
    const adapter = await api(b.page, (d) => d.init());
    console.log(`adapter: ${adapter.device_type} via ${adapter.backend}, ${JSON.stringify(adapter.paths)}`);
    const slow = Boolean(process.env.DOPPLER_BROWSER_SLOW);
    // DOPPLER_BROWSER_ALL=1: every check of `doppler verify`, in one call (about half an
    // hour on SwiftShader on 2 cores; docs/benchmarks.md has the last run).
    const all = process.env.DOPPLER_BROWSER_ALL ? [[undefined, 1800]] : [];
    for (const [filter, secs] of all.length ? all : [...FILTERS, ...SLOW]) {
      const isSlow = SLOW.some(([f]) => f === filter);
      await t.test(filter ?? 'every check', { skip: isSlow && !slow && `about ${secs} s on SwiftShader: DOPPLER_BROWSER_SLOW=1 runs it` }, async () => {
        const t0 = Date.now();
        const r = await api(b.page, (d, f) => d.verify({ filter: f }), filter);
        const s = (Date.now() - t0) / 1000;
        const bad = r.checks.filter((c) => !c.pass);
        total += r.checks.length;
        failed += bad.length;
        const ops = [...new Set(r.checks.map((c) => c.op))].join(', ');
        console.log(`verify ${JSON.stringify(filter)}: ${r.checks.length - bad.length}/${r.checks.length} pass in ${s.toFixed(1)} s (${ops})`);
        for (const c of bad) console.log(`  FAIL ${c.op} ${c.shape}: ${c.error}`);
        assert.ok(r.checks.length > 0, `no check matches ${filter}`);
        if (!filter) console.log(`ops: ${JSON.stringify(Object.entries(r.checks.reduce((m, c) => ({ ...m, [c.op]: (m[c.op] ?? 0) + 1 }), {})))}`);
        assert.equal(r.failed, bad.length);
        assert.deepEqual(bad.map((c) => `${c.op} ${c.shape}: ${c.error}`), []);
      });
    }
  } catch (e) {
    console.log(`--- console of the page ---\n${b.log.join('\n')}\n---`);
    throw e;
  } finally {
    console.log(`verify: ${total - failed}/${total} checks pass in ${b.elapsed().toFixed(1)} s`);
    if (failed) console.log(`--- console of the page ---\n${b.log.join('\n')}\n---`);
  }
});
