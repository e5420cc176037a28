// GroupNorm over x (N, C, S) (S = product of the spatial dims), G groups of C/G channels.
//   mean, rstd (N, G);  xhat = (x - mean[n, g]) * rstd[n, g];  y = xhat * gamma[c] + beta[c]
//   rstd = 1 / sqrt(var + eps), var the biased variance over the group's (C/G) * S values.
// Statistics by Welford per thread and Chan's merge in a tree (never E[x^2] - E[x]^2):
//   gn_channel_stats  one workgroup per (n, c): count S, mean, M2 of the channel
//   gn_group_stats    one thread per (n, g): merges its channels in order -> mean, rstd
//   gn_apply          one thread per element: y
// Backward, with M = (C/G) * S and sums over the group of (n, g):
//   dxhat = dy * gamma;  A = sum(dxhat) / M;  B = sum(dxhat * xhat) / M
//   dx = rstd * (dxhat - A - xhat * B);  dgamma[c] = sum_{n,s} dy * xhat;  dbeta[c] = sum_{n,s} dy
//   gn_bwd_channel    one workgroup per (n, c): sum(dy), sum(dy * xhat) over s
//   gn_bwd_params     one workgroup per c: dgamma, dbeta, a fixed-order tree over n
//   gn_bwd_group      one thread per (n, g): A, B from the channel sums and gamma
//   gn_bwd_dx         one thread per element: dx
// Per-element passes use a linear grid (2-D past 65535 workgroups); so do the per-(n, c) ones.
// No invocation loops more than (N or S) / WG times: besides parallelism, lavapipe (Mesa
// 22) silently stops any loop after 65535 iterations of one invocation.

struct Params {
    n: u32,
    c: u32,
    s: u32,      // spatial size
    g: u32,      // groups
    eps: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;   // power of two

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gamma: array<f32>;
@group(0) @binding(3) var<storage, read> beta: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> chstats: array<vec2<f32>>;   // (N, C): mean, M2
@group(0) @binding(6) var<storage, read_write> mean: array<f32>;            // (N, G)
@group(0) @binding(7) var<storage, read_write> rstd: array<f32>;            // (N, G)
@group(0) @binding(8) var<storage, read> dy: array<f32>;
@group(0) @binding(9) var<storage, read_write> dx: array<f32>;
@group(0) @binding(10) var<storage, read_write> dgamma: array<f32>;
@group(0) @binding(11) var<storage, read_write> dbeta: array<f32>;
@group(0) @binding(12) var<storage, read_write> chsums: array<vec2<f32>>;   // (N, C): sum dy, sum dy*xhat
@group(0) @binding(13) var<storage, read_write> gsums: array<vec2<f32>>;    // (N, G): A, B
@group(0) @binding(14) var<storage, read> mean_in: array<f32>;              // mean, read-only view
@group(0) @binding(15) var<storage, read> rstd_in: array<f32>;              // rstd, read-only view

var<workgroup> w_n: array<f32, WG>;
var<workgroup> w_a: array<f32, WG>;
var<workgroup> w_b: array<f32, WG>;

fn linear(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// (n, g) index of the (n, c) index nc.
fn group_of(nc: u32) -> u32 {
    return (nc / p.c) * p.g + (nc % p.c) / (p.c / p.g);
}

// Workgroup sums of (a, b) over all invocations: a fixed-order tree. Call in uniform
// control flow (it has barriers).
fn sum_pair(lid: u32, a: f32, b: f32) -> vec2<f32> {
    w_a[lid] = a;
    w_b[lid] = b;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            w_a[lid] += w_a[lid + stride];
            w_b[lid] += w_b[lid + stride];
        }
        workgroupBarrier();
    }
    let r = vec2<f32>(w_a[0], w_b[0]);
    workgroupBarrier();
    return r;
}

// Chan et al.: merge (count, mean, M2) of two disjoint sets.
fn merge(na: f32, ma: f32, qa: f32, nb: f32, mb: f32, qb: f32) -> vec3<f32> {
    let nn = na + nb;
    if (nn == 0.0) { return vec3<f32>(0.0); }
    let d = mb - ma;
    return vec3<f32>(nn, ma + d * nb / nn, qa + qb + d * d * na * nb / nn);
}

@compute @workgroup_size(WG)
fn gn_channel_stats(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let nc = linear(wid, nwg);
    let valid = nc < p.n * p.c;   // no early return: barriers below
    var cnt = 0.0;
    var m = 0.0;
    var q = 0.0;
    if (valid) {
        let base = nc * p.s;
        for (var i = lid; i < p.s; i += WG) {
            let v = x[base + i];
            cnt += 1.0;
            let d = v - m;
            m += d / cnt;
            q += d * (v - m);
        }
    }
    w_n[lid] = cnt;
    w_a[lid] = m;
    w_b[lid] = q;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            let r = merge(w_n[lid], w_a[lid], w_b[lid], w_n[lid + stride], w_a[lid + stride], w_b[lid + stride]);
            w_n[lid] = r.x;
            w_a[lid] = r.y;
            w_b[lid] = r.z;
        }
        workgroupBarrier();
    }
    if (valid && lid == 0u) {
        chstats[nc] = vec2<f32>(w_a[0], w_b[0]);
    }
}

@compute @workgroup_size(WG)
fn gn_group_stats(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let ng = linear(wid, nwg) * WG + lid;
    if (ng >= p.n * p.g) { return; }
    let cpg = p.c / p.g;
    let first = (ng / p.g) * p.c + (ng % p.g) * cpg;   // (n, first channel of g)
    var acc = vec3<f32>(0.0);
    for (var k = 0u; k < cpg; k++) {
        let st = chstats[first + k];
        acc = merge(acc.x, acc.y, acc.z, f32(p.s), st.x, st.y);
    }
    mean[ng] = acc.y;
    rstd[ng] = inverseSqrt(acc.z / acc.x + p.eps);
}

@compute @workgroup_size(WG)
fn gn_apply(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg) * WG + lid;
    if (i >= p.n * p.c * p.s) { return; }
    let c = (i / p.s) % p.c;
    let ng = group_of(i / p.s);
    y[i] = (x[i] - mean_in[ng]) * rstd_in[ng] * gamma[c] + beta[c];
}

@compute @workgroup_size(WG)
fn gn_bwd_channel(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let nc = linear(wid, nwg);
    let valid = nc < p.n * p.c;
    var sd = 0.0;
    var sdx = 0.0;
    if (valid) {
        let ng = group_of(nc);
        let mu = mean_in[ng];
        let r = rstd_in[ng];
        let base = nc * p.s;
        for (var i = lid; i < p.s; i += WG) {
            let d = dy[base + i];
            sd += d;
            sdx += d * (x[base + i] - mu) * r;
        }
    }
    let tot = sum_pair(lid, sd, sdx);
    if (valid && lid == 0u) {
        chsums[nc] = tot;
    }
}

@compute @workgroup_size(WG)
fn gn_bwd_params(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let c = linear(wid, nwg);
    let valid = c < p.c;
    var db = 0.0;
    var dg = 0.0;
    if (valid) {
        for (var n = lid; n < p.n; n += WG) {
            let s = chsums[n * p.c + c];
            db += s.x;
            dg += s.y;
        }
    }
    let tot = sum_pair(lid, db, dg);
    if (valid && lid == 0u) {
        dbeta[c] = tot.x;
        dgamma[c] = tot.y;
    }
}

@compute @workgroup_size(WG)
fn gn_bwd_group(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    let ng = linear(wid, nwg) * WG + lid;
    if (ng >= p.n * p.g) { return; }
    let cpg = p.c / p.g;
    let c0 = (ng % p.g) * cpg;
    let row = (ng / p.g) * p.c;
    var a = 0.0;
    var b = 0.0;
    for (var k = 0u; k < cpg; k++) {
        let s = chsums[row + c0 + k];
        let gm = gamma[c0 + k];
        a += gm * s.x;
        b += gm * s.y;
    }
    let m = f32(cpg * p.s);
    gsums[ng] = vec2<f32>(a / m, b / m);
}

@compute @workgroup_size(WG)
fn gn_bwd_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let i = linear(wid, nwg) * WG + lid;
    if (i >= p.n * p.c * p.s) { return; }
    let c = (i / p.s) % p.c;
    let ng = group_of(i / p.s);
    let r = rstd_in[ng];
    let xhat = (x[i] - mean_in[ng]) * r;
    let ab = gsums[ng];
    dx[i] = r * (dy[i] * gamma[c] - ab.x - xhat * ab.y);
}
