// Rotary position embedding on x (..., T, H, Dh), f32.
// Pair p = (i, j) of a head (INTERLEAVED: j = i + 1 for even i, as Meta's and GGUF's Llama;
// otherwise j = i + Dh/2, "rotate half", as Hugging Face's) at position t + offset turns by
// angle = (t + offset) * theta^(-2k/Dh) for the k-th pair:
//   forward:  (x_i, x_j) -> (x_i c - x_j s, x_i s + x_j c)
//   backward: the transpose, a turn by -angle: (g_i c + g_j s, -g_i s + g_j c)
// c and s come from a table (positions, Dh/2, 2) computed on the host in f64: sin and cos
// of large angles in f32 on the GPU have no accuracy guarantee in WGSL.
// One thread per pair (linear grid, 2-D past 65535 workgroups).

struct Params {
    pairs: u32,      // total pairs: rows * T * H * Dh/2
    t: u32,
    h: u32,
    dh: u32,
    offset: u32,     // position of the first row of T
    backward: u32,   // 1: turn by -angle
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 256u;
override INTERLEAVED: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>;   // (positions, Dh/2): (cos, sin)
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let q = (wid.x + wid.y * nwg.x) * WG + lid;
    if (q >= p.pairs) { return; }
    let half = p.dh / 2u;
    let k = q % half;
    let head = q / half;                   // index of (.., t, h)
    let t = (head / p.h) % p.t;
    let base = head * p.dh;
    var i = base + k;
    var j = base + k + half;
    if (INTERLEAVED) {
        i = base + 2u * k;
        j = i + 1u;
    }
    let cs = table[(t + p.offset) * half + k];
    let s = select(cs.y, -cs.y, p.backward != 0u);
    let a = x[i];
    let b = x[j];
    y[i] = a * cs.x - b * s;
    y[j] = a * s + b * cs.x;
}
