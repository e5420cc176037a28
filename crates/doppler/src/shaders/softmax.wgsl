// Softmax over the last axis, x (R, D), f32.
//   y = exp(x - max) / sum(exp(x - max))
//   dx = y * (dy - sum_j dy_j y_j)
// softmax_fwd, softmax_bwd: one workgroup per row (linear grid, 2-D past 65535 rows); the
// row max and sums are fixed-order trees, so reruns give the same bits.

struct Params {
    rows: u32,
    d: u32,
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 256u;   // power of two

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> y_in: array<f32>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> dx: array<f32>;

var<workgroup> red: array<f32, WG>;

// Workgroup max (MAX) or sum of v: a fixed-order tree. Uniform control flow only.
fn tree(lid: u32, v: f32, take_max: bool) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            let o = red[lid + stride];
            red[lid] = select(red[lid] + o, max(red[lid], o), take_max);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn softmax_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.rows;   // no early return: barriers below
    let base = row * p.d;
    var m = -3.0e38;
    if (valid) {
        for (var i = lid; i < p.d; i += WG) { m = max(m, x[base + i]); }
    }
    m = tree(lid, m, true);
    var s = 0.0;
    if (valid) {
        for (var i = lid; i < p.d; i += WG) { s += exp(x[base + i] - m); }
    }
    s = tree(lid, s, false);
    if (valid) {
        let inv = 1.0 / s;
        for (var i = lid; i < p.d; i += WG) { y[base + i] = exp(x[base + i] - m) * inv; }
    }
}

@compute @workgroup_size(WG)
fn softmax_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.rows;
    let base = row * p.d;
    var dot = 0.0;
    if (valid) {
        for (var i = lid; i < p.d; i += WG) { dot += dy[base + i] * y_in[base + i]; }
    }
    dot = tree(lid, dot, false);
    if (valid) {
        for (var i = lid; i < p.d; i += WG) { dx[base + i] = y_in[base + i] * (dy[base + i] - dot); }
    }
}
