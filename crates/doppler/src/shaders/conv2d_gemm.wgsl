// What conv2d.wgsl and conv2d_coop.wgsl share, put before each (shaders/mod.rs): the
// parameters (ops/conv2d.rs's Params), the GEMMs' bindings, their dimensions a mode and
// the store of C (conv2d.wgsl's header spells out the modes).

struct Params {
    n: u32, cin: u32, h: u32, w: u32,
    cout: u32, oh: u32, ow: u32, kh: u32,
    kw: u32, sh: u32, sw: u32, ph: u32,
    pw: u32, dh: u32, dw: u32, groups: u32,
    tiles_p: u32, tiles_m: u32, splits: u32, chunk: u32,   // chunk: K per split (all K: one)
    ry: u32, rx: u32, ky0: u32, kx0: u32,   // a strided dx's residue class (conv2d.rs)
    ty: u32, tx: u32, r0y: u32, r0x: u32,
    th: u32, tw: u32, pad0: u32, pad1: u32,
}

override MODE: u32 = 0u;
override HAS_BIAS: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> wt: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> dy: array<f32>;

fn cin_g() -> u32 { return p.cin / p.groups; }
fn cout_g() -> u32 { return p.cout / p.groups; }
fn khw() -> u32 { return p.kh * p.kw; }
fn ohw() -> u32 { return p.oh * p.ow; }
fn hw() -> u32 { return p.h * p.w; }

fn dim_m() -> u32 { return select(cout_g(), cin_g(), MODE == 1u); }
fn dim_p() -> u32 {
    if (MODE == 0u) { return p.n * ohw(); }
    if (MODE == 1u) { return p.n * hw(); }
    return cin_g() * khw();
}
fn dim_k() -> u32 {
    if (MODE == 0u) { return cin_g() * khw(); }
    if (MODE == 1u) { return cout_g() * khw(); }
    return p.n * ohw();
}

// Element (row m, column col) of C for group g and k split `split`: the NCHW scatter of y
// (plus the bias when k is whole) or dx, or dw's partial; nothing outside C. (No early
// return: the cooperative kernel's coop ops need uniform control flow, and naga counts a
// return on a thread's own condition against a caller.) Split-K outputs go at split * |C|.
fn store(g: u32, split: u32, m: u32, col: u32, v: f32) {
    if (m < dim_m() && col < dim_p()) {
        if (MODE == 0u) {
            let co = g * cout_g() + m;
            var r = v;
            if (HAS_BIAS && p.splits == 1u) { r += bias[co]; }
            out[split * p.n * p.cout * ohw() + ((col / ohw()) * p.cout + co) * ohw() + col % ohw()] = r;
        } else if (MODE == 1u) {
            out[split * p.n * p.cin * hw() + ((col / hw()) * p.cin + g * cin_g() + m) * hw() + col % hw()] = v;
        } else {
            out[(split * p.cout + g * cout_g() + m) * dim_p() + col] = v;
        }
    }
}
