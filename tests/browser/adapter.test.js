// init(): the adapter report, as `doppler info --json` gives it natively.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { api, withBrowser } from './helpers.js';

test('init() reports the adapter, its limits and the kernel paths', async (t) => {
  await withBrowser(t, async ({ page }) => {
    const r = await api(page, (d) => d.init());
    console.log(`adapter: name ${JSON.stringify(r.name)}, backend ${r.backend}, device_type ${r.device_type}, ` +
      `matmul ${r.matmul}, paths ${JSON.stringify(r.paths)}, features ${r.features.join(' ')}`);
    for (const k of ['name', 'backend', 'device_type', 'driver', 'features', 'limits', 'matmul', 'paths']) {
      assert.ok(k in r, `init(): no field ${k} in ${JSON.stringify(r)}`);
    }
    assert.equal(r.backend.toLowerCase(), 'browserwebgpu', `backend ${r.backend}`);
    assert.ok(Array.isArray(r.features));
    for (const k of ['max_storage_buffers_per_shader_stage', 'max_compute_workgroup_storage_size']) {
      assert.equal(typeof r.limits[k], 'number', `limits.${k}: ${JSON.stringify(r.limits)}`);
    }
    assert.ok(['f32', 'f16x3', 'f16'].includes(r.matmul));
    for (const k of ['matmul', 'attention_d64', 'shader_f16', 'subgroups', 'timestamps', 'per_kernel_times']) {
      assert.ok(k in r.paths, `paths.${k} missing: ${JSON.stringify(r.paths)}`);
    }
    if (!r.features.includes('shader-f16') && !r.features.includes('SHADER_F16')) {
      // SwiftShader (no shader-f16, no cooperative matrices): the subgroup-free rows path.
      assert.equal(r.paths.attention_d64, 'rows');
      assert.equal(r.paths.shader_f16, false);
    }
    // A second call answers from the same device.
    const again = await api(page, (d) => d.init());
    assert.deepEqual(again.limits, r.limits);
  });
});
