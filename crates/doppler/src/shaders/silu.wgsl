// SiLU and SwiGLU, f32, flat over n elements; one element a thread (linear grid, 2-D past
// 65535 workgroups).
//   silu(a) = a * s(a),  s = 1 / (1 + exp(-a));  silu'(a) = s(a) * (1 + a * (1 - s(a)))
//   silu_fwd:   out = silu(a)                 silu_bwd:   da = dy * silu'(a)
//   swiglu_fwd: out = silu(a) * b             swiglu_bwd: da = dy * b * silu'(a), db = dy * silu(a)
// exp(-a) overflows to inf for a << 0 and s(a) = 1 / inf = 0, the exact limit.

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> da: array<f32>;
@group(0) @binding(6) var<storage, read_write> db: array<f32>;

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }
fn silu_grad(v: f32) -> f32 {
    let s = sigmoid(v);
    return s * (1.0 + v * (1.0 - s));
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn silu_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = a[i] * sigmoid(a[i]); }
}

@compute @workgroup_size(WG)
fn silu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { da[i] = dy[i] * silu_grad(a[i]); }
}

@compute @workgroup_size(WG)
fn swiglu_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = a[i] * sigmoid(a[i]) * b[i]; }
}

@compute @workgroup_size(WG)
fn swiglu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) {
        let v = a[i];
        da[i] = dy[i] * b[i] * silu_grad(v);
        db[i] = dy[i] * v * sigmoid(v);
    }
}
