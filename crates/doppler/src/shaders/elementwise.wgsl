// Elementwise f32 ops over n elements, flat.
//   add:   out[i] = a[i] + b[i]
//   mul:   out[i] = a[i] * b[i]
//   scale: out[i] = alpha * a[i]
//   softcap: out[i] = alpha * tanh(a[i] / alpha)   (Gemma's logit soft-capping), tanh(y)
//          as sign(y) (1 - e) / (1 + e), e = exp(-2|y|): no overflow, exact limits
// The *4 entry points do the same on vec4 views of the same buffers (n % 4 == 0).
// Grid: linear, possibly 2-D past 65535 workgroups; one element (or vec4) per thread.

struct Params {
    n: u32,        // elements (vec4 entry points: vec4s)
    alpha: f32,
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> b4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out4: array<vec4<f32>>;

// Workgroup number on a grid that may be 2-D (see Grid::Linear), times WG, plus the lane.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = a[i] + b[i]; }
}

@compute @workgroup_size(WG)
fn mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = a[i] * b[i]; }
}

@compute @workgroup_size(WG)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = p.alpha * a[i]; }
}

@compute @workgroup_size(WG)
fn add4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out4[i] = a4[i] + b4[i]; }
}

@compute @workgroup_size(WG)
fn mul4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out4[i] = a4[i] * b4[i]; }
}

@compute @workgroup_size(WG)
fn scale4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out4[i] = p.alpha * a4[i]; }
}

fn capped(x: f32) -> f32 {
    let y = x / p.alpha;
    let e = exp(-2.0 * abs(y));
    return p.alpha * sign(y) * ((1.0 - e) / (1.0 + e));
}

@compute @workgroup_size(WG)
fn softcap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = capped(a[i]); }
}
