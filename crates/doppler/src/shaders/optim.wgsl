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
// Many tensors a dispatch (adamw_multi, sumsq_multi): SLOTS tensors, each bound at its own
// bindings (p, g, m, v per slot: 4 x 7 + 1 storage buffers, where the adapter allows it),
// the workgroups split among them in slot order by the cumulative `ends`. A per-tensor
// dispatch waits for the one before it (each writes a buffer a kernel before it used), so
// 196 tensors cost 196 launches and waits; 7 a dispatch cost 28. Same arithmetic per
// element, same chunks and partials as the per-tensor kernels.
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
    // adamw_multi / sumsq_multi: per slot, the end of its workgroups (cumulative), its
    // element count, and adamw's 1 - lr * wd (SLOTS of the 8 entries used).
    ends: array<vec4<u32>, 2>,
    ns: array<vec4<u32>, 2>,
    decays: array<vec4<f32>, 2>,
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

// Tensors of one multi-tensor dispatch: slot s holds param_s, grad_s, m1_s, m2_s.
const SLOTS: u32 = 7u;   // 4 x 7 + 1 = 29 storage buffers (lavapipe allows 32)
@group(0) @binding(16) var<storage, read_write> param_0: array<f32>;
@group(0) @binding(17) var<storage, read_write> param_1: array<f32>;
@group(0) @binding(18) var<storage, read_write> param_2: array<f32>;
@group(0) @binding(19) var<storage, read_write> param_3: array<f32>;
@group(0) @binding(20) var<storage, read_write> param_4: array<f32>;
@group(0) @binding(21) var<storage, read_write> param_5: array<f32>;
@group(0) @binding(22) var<storage, read_write> param_6: array<f32>;
@group(0) @binding(24) var<storage, read> grad_0: array<f32>;
@group(0) @binding(25) var<storage, read> grad_1: array<f32>;
@group(0) @binding(26) var<storage, read> grad_2: array<f32>;
@group(0) @binding(27) var<storage, read> grad_3: array<f32>;
@group(0) @binding(28) var<storage, read> grad_4: array<f32>;
@group(0) @binding(29) var<storage, read> grad_5: array<f32>;
@group(0) @binding(30) var<storage, read> grad_6: array<f32>;
@group(0) @binding(32) var<storage, read_write> m1_0: array<f32>;
@group(0) @binding(33) var<storage, read_write> m1_1: array<f32>;
@group(0) @binding(34) var<storage, read_write> m1_2: array<f32>;
@group(0) @binding(35) var<storage, read_write> m1_3: array<f32>;
@group(0) @binding(36) var<storage, read_write> m1_4: array<f32>;
@group(0) @binding(37) var<storage, read_write> m1_5: array<f32>;
@group(0) @binding(38) var<storage, read_write> m1_6: array<f32>;
@group(0) @binding(40) var<storage, read_write> m2_0: array<f32>;
@group(0) @binding(41) var<storage, read_write> m2_1: array<f32>;
@group(0) @binding(42) var<storage, read_write> m2_2: array<f32>;
@group(0) @binding(43) var<storage, read_write> m2_3: array<f32>;
@group(0) @binding(44) var<storage, read_write> m2_4: array<f32>;
@group(0) @binding(45) var<storage, read_write> m2_5: array<f32>;
@group(0) @binding(46) var<storage, read_write> m2_6: array<f32>;

// Which slot workgroup w belongs to (SLOTS when w is past the last), and where its
// workgroups start.
fn slot_of(w: u32) -> vec2<u32> {
    var start = 0u;
    for (var s = 0u; s < SLOTS; s++) {
        let end = p.ends[s / 4u][s % 4u];
        if (w < end) { return vec2<u32>(s, start); }
        start = end;
    }
    return vec2<u32>(SLOTS, start);
}

// adamw_step's update of one element: (p, m, v) after the step, g already scaled.
fn adam(pv: f32, g: f32, mv: f32, vv: f32, decay: f32) -> vec3<f32> {
    let m = p.b1 * mv + p.omb1 * g;
    let v = p.b2 * vv + p.omb2 * g * g;
    return vec3<f32>(pv * decay - p.step_size * m / (sqrt(v) / p.bc2_sqrt + p.eps), m, v);
}

@compute @workgroup_size(WG)
fn adamw_multi(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = wid.x + wid.y * nwg.x;
    let at = slot_of(w);
    let s = at.x;
    if (s >= SLOTS) { return; }
    let n = p.ns[s / 4u][s % 4u];
    let d = p.decays[s / 4u][s % 4u];
    let f = scale[1];
    let i = (w - at.y) * WG + lid;   // one element a thread
    if (i < n) {
        var x: vec4<f32>;   // (p, g, m, v)
        switch s {
            case 0u: { x = vec4(param_0[i], grad_0[i], m1_0[i], m2_0[i]); }
            case 1u: { x = vec4(param_1[i], grad_1[i], m1_1[i], m2_1[i]); }
            case 2u: { x = vec4(param_2[i], grad_2[i], m1_2[i], m2_2[i]); }
            case 3u: { x = vec4(param_3[i], grad_3[i], m1_3[i], m2_3[i]); }
            case 4u: { x = vec4(param_4[i], grad_4[i], m1_4[i], m2_4[i]); }
            case 5u: { x = vec4(param_5[i], grad_5[i], m1_5[i], m2_5[i]); }
            default: { x = vec4(param_6[i], grad_6[i], m1_6[i], m2_6[i]); }
        }
        let r = adam(x.x, x.y * f, x.z, x.w, d);
        switch s {
            case 0u: { param_0[i] = r.x; m1_0[i] = r.y; m2_0[i] = r.z; }
            case 1u: { param_1[i] = r.x; m1_1[i] = r.y; m2_1[i] = r.z; }
            case 2u: { param_2[i] = r.x; m1_2[i] = r.y; m2_2[i] = r.z; }
            case 3u: { param_3[i] = r.x; m1_3[i] = r.y; m2_3[i] = r.z; }
            case 4u: { param_4[i] = r.x; m1_4[i] = r.y; m2_4[i] = r.z; }
            case 5u: { param_5[i] = r.x; m1_5[i] = r.y; m2_5[i] = r.z; }
            default: { param_6[i] = r.x; m1_6[i] = r.y; m2_6[i] = r.z; }
        }
    }
}

// sumsq_partial over SLOTS gradients: workgroup w sums chunk (w - its slot's start) of its
// slot's gradient into partials[p.offset + w], the slots' chunks numbered in order as
// consecutive per-tensor dispatches number them.
@compute @workgroup_size(WG)
fn sumsq_multi(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let w = wid.x + wid.y * nwg.x;
    let at = slot_of(w);
    let s = at.x;
    if (s >= SLOTS) { return; }
    let start = (w - at.y) * WG * ITEMS;
    let end = min(start + WG * ITEMS, p.ns[s / 4u][s % 4u]);
    // The loop inside each case, of a constant count (unrolled; loads predicated).
    var acc = 0.0;
    switch s {
        case 0u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_0[i] * grad_0[i]; }
            }
        }
        case 1u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_1[i] * grad_1[i]; }
            }
        }
        case 2u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_2[i] * grad_2[i]; }
            }
        }
        case 3u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_3[i] * grad_3[i]; }
            }
        }
        case 4u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_4[i] * grad_4[i]; }
            }
        }
        case 5u: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_5[i] * grad_5[i]; }
            }
        }
        default: {
            for (var j = 0u; j < ITEMS; j++) {
                let i = start + lid + j * WG;
                if (i < end) { acc += grad_6[i] * grad_6[i]; }
            }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { red[lid] += red[lid + stride]; }
        workgroupBarrier();
    }
    if (lid == 0u) { partials[p.offset + w] = red[0]; }
}
