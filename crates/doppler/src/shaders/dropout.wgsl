// Seeded dropout, f32, one element a thread (linear grid, 2-D past 65535 workgroups).
//   keep_i = u(seed, i) >= p, u uniform in [0, 1) from a counter-based hash of (seed, i),
//   y = keep ? x * scale : 0, scale = 1 / (1 - p) (from the host, in f64 then f32)
// The backward regenerates the same mask from (seed, i): dx = keep ? dy * scale : 0. No
// mask is stored, and the same seed gives the same mask on every run and device.

struct Params {
    n: u32,
    seed_lo: u32,
    seed_hi: u32,
    threshold: u32,   // keep when the 24-bit draw >= threshold = round(p * 2^24)
    scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// PCG-style integer hash (O'Neill's PCG output permutation over an LCG step).
fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn keep(i: u32) -> bool {
    let h = pcg(pcg(i ^ pcg(p.seed_lo)) ^ p.seed_hi);
    return (h >> 8u) >= p.threshold;
}

// Forward and backward are the same map: x -> mask * scale * x.
@compute @workgroup_size(WG)
fn dropout(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.n) { return; }
    y[i] = select(0.0, x[i] * p.scale, keep(i));
}
