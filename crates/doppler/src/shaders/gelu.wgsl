// GELU, forward and backward, f32, flat over n elements; matches PyTorch's
// gelu(approximate='none') and gelu(approximate='tanh').
//   exact (TANH = false):
//     y  = x * Phi(x),            Phi(x) = 0.5 * erfc(-x / sqrt(2))
//     dy/dx = Phi(x) + x * phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   tanh (TANH = true):
//     y  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
//     dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// gelu_fwd: out = gelu(x).  gelu_bwd: out = dy * gelu'(x).
// gelu_fwd4, gelu_bwd4: the same on vec4 views when n is a multiple of 4 (16-byte loads:
// these kernels only move memory).
// Grid: linear, possibly 2-D past 65535 workgroups; one element (or vec4) per thread.

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;
override TANH: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> dy: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> dy4: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> out4: array<vec4<f32>>;

const SQRT_HALF: f32 = 0.70710678118654752;
const INV_SQRT_2PI: f32 = 0.39894228040143268;
const SQRT_2_OVER_PI: f32 = 0.79788456080286536;
const TANH_C: f32 = 0.044715;

// erfc(z) for z >= 0 with fractional error below 1.2e-7 everywhere (Chebyshev fit,
// Numerical Recipes' erfcc). WGSL has no erf; computing erfc directly keeps Phi(x)
// accurate in relative terms for very negative x, where 1 + erf(z) would cancel.
fn erfc_pos(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
        t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
        t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(-z * z + poly);
}

// Standard normal CDF.
fn phi_cdf(v: f32) -> f32 {
    let h = 0.5 * erfc_pos(abs(v) * SQRT_HALF);
    return select(h, 1.0 - h, v > 0.0);
}

// 1 + tanh(u) and 1 - tanh(u) as 2 / (1 + exp(-+2u)): no cancellation where tanh(u) is
// near -1 or 1 (0.5 x (1 + tanh u) for x << 0 would lose every digit), and exp's overflow
// to inf gives the exact limits 0 and 2 instead of NaN.
fn tanh_terms(v: f32) -> vec2<f32> {
    let u = SQRT_2_OVER_PI * (v + TANH_C * v * v * v);
    return vec2<f32>(2.0 / (1.0 + exp(-2.0 * u)), 2.0 / (1.0 + exp(2.0 * u)));
}

fn gelu(v: f32) -> f32 {
    if (TANH) { return 0.5 * v * tanh_terms(v).x; }
    return v * phi_cdf(v);
}

fn gelu_grad(v: f32) -> f32 {
    if (TANH) {
        let t = tanh_terms(v);   // 1 - tanh^2 = (1 + tanh)(1 - tanh)
        return 0.5 * t.x + 0.5 * v * t.x * t.y * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_C * v * v);
    }
    return phi_cdf(v) + v * INV_SQRT_2PI * exp(-0.5 * v * v);
}

fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * WG + lid;
}

@compute @workgroup_size(WG)
fn gelu_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = gelu(x[i]); }
}

@compute @workgroup_size(WG)
fn gelu_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n) { out[i] = dy[i] * gelu_grad(x[i]); }
}

@compute @workgroup_size(WG)
fn gelu_fwd4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n / 4u) {
        let v = x4[i];
        out4[i] = vec4<f32>(gelu(v.x), gelu(v.y), gelu(v.z), gelu(v.w));
    }
}

@compute @workgroup_size(WG)
fn gelu_bwd4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = flat_index(wid, nwg, lid);
    if (i < p.n / 4u) {
        let v = x4[i];
        out4[i] = dy4[i] * vec4<f32>(gelu_grad(v.x), gelu_grad(v.y), gelu_grad(v.z), gelu_grad(v.w));
    }
}
