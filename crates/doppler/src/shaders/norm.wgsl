// Row normalisations over the last axis, x (R, D): LayerNorm and RMSNorm, f32.
//   LayerNorm (RMS = false): xhat = (x - mean) * rstd,  rstd = 1 / sqrt(var + eps)
//                            y = xhat * w + b
//   RMSNorm   (RMS = true):  xhat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps)
//                            y = xhat * w', w' = w, or 1 + w when ONE_PLUS (Gemma style)
// Backward, per row, with g = dy * w' (LayerNorm: w' = w) and means over D:
//   LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
//   dw = sum over rows of dy * xhat,  db = sum over rows of dy   (LayerNorm)
// norm_fwd     one workgroup per row: statistics (Welford / sum of squares, a tree), then y;
//              saves mean (LayerNorm) and rstd per row
// norm_bwd_dx  one workgroup per row: the two row means (a tree), then dx; with ADD, dx
//              plus another gradient of x (add_in: a residual branch's), in one pass
// norm_bwd_wp  one thread per (column, block of 64 rows): partial dw, db over the block
//              (blocks of 256: 96 workgroups for GPT-2's 8192 x 768, 45 us on an H200)
// norm_bwd_w   one thread per column: dw, db = sums of the block partials in order
// norm_heads   RMSNorm of each query and key head in place (Qwen3, Gemma 3): y holds
//              stacked projections, (HQ + 2 HKV) heads of D a token (q, k, v); one
//              workgroup per (token, head) of the first HQ + HKV, q's weight w[0..D) for
//              the HQ query heads, k's w[D..2D) for the HKV key heads; v is not touched
// Every sum has a fixed order: the same bits on every run. Rows: linear grid (2-D past 65535).

struct Params {
    rows: u32,
    d: u32,
    eps: f32,
    blocks: u32,   // ceil(rows / ROWS_PER_BLOCK), for the weight gradient
}

override WG: u32 = 256u;   // power of two
override RMS: bool = false;
override ONE_PLUS: bool = false;
override ADD: bool = false;
override HQ: u32 = 1u;     // norm_heads: query heads a token
override HKV: u32 = 1u;    // norm_heads: key (and value) heads a token
const ROWS_PER_BLOCK: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> mean: array<f32>;     // (R)
@group(0) @binding(6) var<storage, read_write> rstd: array<f32>;     // (R)
@group(0) @binding(7) var<storage, read> dy: array<f32>;
@group(0) @binding(8) var<storage, read_write> dx: array<f32>;
@group(0) @binding(9) var<storage, read_write> partial: array<vec2<f32>>;  // (blocks, D): dw, db
@group(0) @binding(10) var<storage, read_write> dw: array<f32>;
@group(0) @binding(11) var<storage, read_write> db: array<f32>;
@group(0) @binding(12) var<storage, read> mean_in: array<f32>;
@group(0) @binding(13) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(14) var<storage, read> add_in: array<f32>;      // (R, D), read with ADD

var<workgroup> s_n: array<f32, WG>;
var<workgroup> s_a: array<f32, WG>;
var<workgroup> s_b: array<f32, WG>;

fn weight(c: u32) -> f32 {
    if (ONE_PLUS) { return 1.0 + w[c]; }
    return w[c];
}

// Workgroup sums of (a, b): a fixed-order tree. Uniform control flow only.
fn sum_pair(lid: u32, a: f32, bb: f32) -> vec2<f32> {
    s_a[lid] = a;
    s_b[lid] = bb;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            s_a[lid] += s_a[lid + stride];
            s_b[lid] += s_b[lid + stride];
        }
        workgroupBarrier();
    }
    let r = vec2<f32>(s_a[0], s_b[0]);
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn norm_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.rows;   // no early return: barriers below
    let base = row * p.d;
    var mu = 0.0;
    var r = 0.0;
    if (RMS) {
        var ss = 0.0;
        if (valid) {
            for (var i = lid; i < p.d; i += WG) { ss += x[base + i] * x[base + i]; }
        }
        let t = sum_pair(lid, ss, 0.0);
        r = inverseSqrt(t.x / f32(p.d) + p.eps);
    } else {
        // Welford per thread, Chan's merge in the tree.
        var cnt = 0.0;
        var m = 0.0;
        var q = 0.0;
        if (valid) {
            for (var i = lid; i < p.d; i += WG) {
                let v = x[base + i];
                cnt += 1.0;
                let dd = v - m;
                m += dd / cnt;
                q += dd * (v - m);
            }
        }
        s_n[lid] = cnt;
        s_a[lid] = m;
        s_b[lid] = q;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
            if (lid < stride) {
                let na = s_n[lid];
                let nb = s_n[lid + stride];
                let nn = na + nb;
                if (nn > 0.0) {
                    let dd = s_a[lid + stride] - s_a[lid];
                    s_a[lid] += dd * nb / nn;
                    s_b[lid] += s_b[lid + stride] + dd * dd * na * nb / nn;
                    s_n[lid] = nn;
                }
            }
            workgroupBarrier();
        }
        mu = s_a[0];
        r = inverseSqrt(s_b[0] / s_n[0] + p.eps);
    }
    if (valid) {
        for (var i = lid; i < p.d; i += WG) {
            var v = (x[base + i] - mu) * r * weight(i);
            if (!RMS) { v += b[i]; }
            y[base + i] = v;
        }
        if (lid == 0u) {
            mean[row] = mu;
            rstd[row] = r;
        }
    }
}

@compute @workgroup_size(WG)
fn norm_bwd_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.rows;
    let base = row * p.d;
    var mu = 0.0;
    var r = 0.0;
    var sg = 0.0;
    var sgx = 0.0;
    if (valid) {
        if (!RMS) { mu = mean_in[row]; }
        r = rstd_in[row];
        for (var i = lid; i < p.d; i += WG) {
            let g = dy[base + i] * weight(i);
            sg += g;
            sgx += g * (x[base + i] - mu) * r;
        }
    }
    let t = sum_pair(lid, sg, sgx) / f32(p.d);
    if (valid) {
        for (var i = lid; i < p.d; i += WG) {
            let xhat = (x[base + i] - mu) * r;
            var v = dy[base + i] * weight(i) - xhat * t.y;
            if (!RMS) { v -= t.x; }
            var out = r * v;
            if (ADD) { out += add_in[base + i]; }
            dx[base + i] = out;
        }
    }
}

@compute @workgroup_size(WG)
fn norm_bwd_wp(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.blocks * p.d) { return; }
    let blk = i / p.d;
    let c = i % p.d;
    let end = min((blk + 1u) * ROWS_PER_BLOCK, p.rows);
    var sw = 0.0;
    var sb = 0.0;
    for (var row = blk * ROWS_PER_BLOCK; row < end; row++) {
        var mu = 0.0;
        if (!RMS) { mu = mean_in[row]; }
        let g = dy[row * p.d + c];
        sw += g * (x[row * p.d + c] - mu) * rstd_in[row];
        sb += g;
    }
    partial[i] = vec2<f32>(sw, sb);
}

@compute @workgroup_size(WG)
fn norm_bwd_w(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let c = (wid.x + wid.y * nwg.x) * WG + lid;
    if (c >= p.d) { return; }
    var acc = vec2<f32>(0.0);
    for (var blk = 0u; blk < p.blocks; blk++) { acc += partial[blk * p.d + c]; }
    dw[c] = acc.x;
    if (!RMS) { db[c] = acc.y; }
}

@compute @workgroup_size(WG)
fn norm_heads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;   // token * (HQ + HKV) + head
    let valid = row < p.rows;          // no early return: barriers below
    let tok = row / (HQ + HKV);
    let h = row % (HQ + HKV);
    let base = (tok * (HQ + 2u * HKV) + h) * p.d;
    let wbase = select(0u, p.d, h >= HQ);
    var ss = 0.0;
    if (valid) {
        for (var i = lid; i < p.d; i += WG) { ss += y[base + i] * y[base + i]; }
    }
    let t = sum_pair(lid, ss, 0.0);
    let r = inverseSqrt(t.x / f32(p.d) + p.eps);
    if (valid) {
        for (var i = lid; i < p.d; i += WG) {
            y[base + i] = y[base + i] * r * weight(wbase + i);
        }
    }
}
