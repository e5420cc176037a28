// Optimizer steps on the GPU, f32, one thread per parameter element (linear grid, 2-D past
// 65535 workgroups; adamw_step4: four elements a thread on vec4 views, for sizes that are
// multiples of 4, the same arithmetic per element), following PyTorch's non-fused
// torch.optim formulas. The gradient is first multiplied by scale[1] (global-norm clipping
// factor and/or 1 / loss scale), read from a GPU buffer so that no value comes back to the
// host.
//   adamw_step (t = step number, from 1; bc1 = 1 - b1^t, bc2 = 1 - b2^t):
//     p = p * (1 - lr * wd)
//     m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//     p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//   sgd_step (momentum mu, dampening d, NESTEROV; FIRST: the first step, buf = g):
//     g = g + wd p;  buf = mu buf + (1 - d) g;  g = NESTEROV ? g + mu buf : buf;  p = p - lr g
// Derived constants (1 - b1, 1 - b2, 1 - lr wd, lr / bc1, sqrt(bc2), 1 - d) come from the
// host, computed in f64 as PyTorch does: 1 - b2 formed in f32 from f32(0.999) would be off
// by 1e-5 relative.
// Global norm: sumsq_partial, one workgroup per chunk of 4096 elements of one gradient,
// writes the chunk's sum of squares (fixed-order tree) into partials[offset + chunk];
// clip_factor, one workgroup, sums all partials in order and writes
//   scale = (norm, min(1, max_norm / (norm + 1e-6)) / loss_scale), norm that of the
//   unscaled gradients (the grads' norm / loss_scale): clipping as if there were no scale.

struct Params {
    n: u32,
    offset: u32,      // sumsq_partial: first slot in partials; clip_factor: number of partials
    lr: f32,
    wd: f32,
    b1: f32,          // adamw: beta1; sgd: momentum
    b2: f32,          // adamw: beta2
    omb1: f32,        // 1 - beta1
    omb2: f32,        // adamw: 1 - beta2; sgd: 1 - dampening
    eps: f32,
    decay: f32,       // 1 - lr * wd
    step_size: f32,   // lr / bc1
    bc2_sqrt: f32,    // sqrt(bc2)
    max_norm: f32,    // clip_factor: <= 0 means no clipping
    loss_scale: f32,
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 256u;   // power of two
override NESTEROV: bool = false;
override FIRST: bool = false;
const ITEMS: u32 = 16u;    // elements a thread per sumsq chunk

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> m1: array<f32>;       // adamw m, sgd momentum buffer
@group(0) @binding(4) var<storage, read_write> m2: array<f32>;       // adamw v
@group(0) @binding(5) var<storage, read> scale: array<f32>;          // (norm, factor)
@group(0) @binding(6) var<storage, read_write> partials: array<f32>;
@group(0) @binding(7) var<storage, read_write> scale_out: array<f32>;
@group(0) @binding(8) var<storage, read_write> param4: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> grad4: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> m14: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> m24: array<vec4<f32>>;

var<workgroup> red: array<f32, WG>;

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn adamw_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    let g = grad[i] * scale[1];
    let m = p.b1 * m1[i] + p.omb1 * g;
    let v = p.b2 * m2[i] + p.omb2 * g * g;
    m1[i] = m;
    m2[i] = v;
    param[i] = param[i] * p.decay - p.step_size * m / (sqrt(v) / p.bc2_sqrt + p.eps);
}

@compute @workgroup_size(WG)
fn adamw_step4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n / 4u) { return; }
    let g = grad4[i] * scale[1];
    let m = p.b1 * m14[i] + p.omb1 * g;
    let v = p.b2 * m24[i] + p.omb2 * g * g;
    m14[i] = m;
    m24[i] = v;
    param4[i] = param4[i] * p.decay - p.step_size * m / (sqrt(v) / p.bc2_sqrt + p.eps);
}

@compute @workgroup_size(WG)
fn sgd_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i >= p.n) { return; }
    var g = grad[i] * scale[1] + p.wd * param[i];
    if (p.b1 != 0.0) {
        var buf = g;
        if (!FIRST) { buf = p.b1 * m1[i] + p.omb2 * g; }
        m1[i] = buf;
        g = select(buf, g + p.b1 * buf, NESTEROV);
    }
    param[i] = param[i] - p.lr * g;
}

@compute @workgroup_size(WG)
fn sumsq_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let chunk = wid.x + wid.y * nwg.x;
    let start = chunk * WG * ITEMS;
    let end = min(start + WG * ITEMS, p.n);
    var s = 0.0;
    for (var i = start + lid; i < end; i += WG) { s += grad[i] * grad[i]; }
    red[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { red[lid] += red[lid + stride]; }
        workgroupBarrier();
    }
    if (lid == 0u && start < p.n) { partials[p.offset + chunk] = red[0]; }
}

@compute @workgroup_size(WG)
fn clip_factor(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var i = lid; i < p.offset; i += WG) { s += partials[i]; }
    red[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { red[lid] += red[lid + stride]; }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let norm = sqrt(red[0]) / p.loss_scale;   // of the unscaled gradients
        var f = 1.0;
        if (p.max_norm > 0.0) { f = min(1.0, p.max_norm / (norm + 1e-6)); }
        scale_out[0] = norm;
        scale_out[1] = f / p.loss_scale;
    }
}
