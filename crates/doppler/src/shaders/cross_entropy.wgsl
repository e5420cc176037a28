// Cross-entropy on logits: fused, numerically stable log-softmax + NLL, f32.
//   logits (T, V), targets (T) u32; a target equal to `ignore` (when has_ignore) is ignored.
// ce_fwd, one workgroup per row t (linear grid, 2-D past 65535 rows):
//   lse_t  = m + log(sum_j exp(x_tj - m)), m = max_j x_tj; one pass over the row: each
//            thread keeps a running max and a sum rescaled when the max grows, and a tree
//            merges (m1, s1), (m2, s2) -> (m, s1 e^(m1-m) + s2 e^(m2-m)).
//   loss_t = (1 - eps)(lse_t - x_t,y) + eps (lse_t - mean_j x_tj)   (label smoothing eps)
//            0 for ignored rows. A target >= V (not ignored) is counted in `flag` (the host
//            reports it as an error) and its row treated as ignored.
// ce_mean, one workgroup: stats = (sum_t loss_t / count, count), count = non-ignored rows;
//   fixed order (strided per-thread sums, then a tree). count == 0 gives NaN, as PyTorch.
// ce_bwd, one thread per logit (linear grid, 2-D past 65535 workgroups):
//   dlogits_tj = (exp(x_tj - lse_t) - q_tj) * g_t,  q_tj = (1 - eps)[j == y_t] + eps / V
//   g_t = g[0] / count (MEAN) or g[t] (per-token); 0 for ignored rows.
// ce_bwd4: the same on vec4s (4 consecutive logits of one row) when V % 4 == 0.

struct Params {
    t: u32,          // rows (tokens)
    v: u32,          // vocabulary
    ignore: u32,
    has_ignore: u32,
    eps: f32,        // label smoothing
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 256u;   // power of two
override MEAN: bool = true;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> loss: array<f32>;      // (T)
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;       // (T)
@group(0) @binding(5) var<storage, read_write> flag: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> stats: array<f32>;     // (mean, count)
@group(0) @binding(7) var<storage, read_write> dlogits: array<f32>;   // (T, V)
@group(0) @binding(8) var<storage, read> g: array<f32>;               // (1) or (T)
@group(0) @binding(9) var<storage, read> stats_in: array<f32>;        // stats, read-only view
@group(0) @binding(10) var<storage, read> lse_in: array<f32>;         // lse, read-only view
@group(0) @binding(11) var<storage, read> logits4: array<vec4<f32>>;  // logits as vec4 (V % 4 == 0)
@group(0) @binding(12) var<storage, read_write> dlogits4: array<vec4<f32>>;

var<workgroup> sm: array<f32, WG>;
var<workgroup> ss: array<f32, WG>;
var<workgroup> sx: array<f32, WG>;

// Finite "minus infinity": merging two empty partials must give 0, not exp(NaN).
const NEG_BIG: f32 = -3.0e38;

fn ignored(y: u32) -> bool {
    return (p.has_ignore != 0u && y == p.ignore) || y >= p.v;
}

@compute @workgroup_size(WG)
fn ce_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let valid = row < p.t;   // no early return: barriers below
    var m = NEG_BIG;
    var s = 0.0;
    var sum_x = 0.0;
    if (valid) {
        let base = row * p.v;
        for (var j = lid; j < p.v; j += WG) {
            let x = logits[base + j];
            if (x > m) {
                s = s * exp(m - x);
                m = x;
            }
            s += exp(x - m);
            sum_x += x;
        }
    }
    sm[lid] = m;
    ss[lid] = s;
    sx[lid] = sum_x;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            let m1 = sm[lid];
            let m2 = sm[lid + stride];
            let mm = max(m1, m2);
            ss[lid] = ss[lid] * exp(m1 - mm) + ss[lid + stride] * exp(m2 - mm);
            sm[lid] = mm;
            sx[lid] += sx[lid + stride];
        }
        workgroupBarrier();
    }
    if (valid && lid == 0u) {
        let l = sm[0] + log(ss[0]);
        lse[row] = l;
        let y = targets[row];
        if (y >= p.v && !(p.has_ignore != 0u && y == p.ignore)) {
            atomicAdd(&flag[0], 1u);
            atomicMax(&flag[1], 0xffffffffu - row);   // keeps the first bad row
        }
        if (ignored(y)) {
            loss[row] = 0.0;
        } else {
            let nll = l - logits[row * p.v + y];
            let smoothed = l - sx[0] / f32(p.v);
            loss[row] = (1.0 - p.eps) * nll + p.eps * smoothed;
        }
    }
}

@compute @workgroup_size(WG)
fn ce_mean(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    var c = 0.0;
    for (var t = lid; t < p.t; t += WG) {
        if (!ignored(targets[t])) {
            s += loss[t];
            c += 1.0;
        }
    }
    sm[lid] = s;
    ss[lid] = c;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            sm[lid] += sm[lid + stride];
            ss[lid] += ss[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        stats[0] = sm[0] / ss[0];
        stats[1] = ss[0];
    }
}

@compute @workgroup_size(WG)
fn ce_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.t * p.v) { return; }
    let row = i / p.v;
    let j = i % p.v;
    let y = targets[row];
    if (ignored(y)) {
        dlogits[i] = 0.0;
        return;
    }
    var gt: f32;
    if (MEAN) { gt = g[0] / stats_in[1]; } else { gt = g[row]; }
    let prob = exp(logits[i] - lse_in[row]);
    let q = select(0.0, 1.0 - p.eps, j == y) + p.eps / f32(p.v);
    dlogits[i] = (prob - q) * gt;
}

@compute @workgroup_size(WG)
fn ce_bwd4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.t * p.v / 4u) { return; }
    let row = (4u * i) / p.v;
    let j = (4u * i) % p.v;
    let y = targets[row];
    if (ignored(y)) {
        dlogits4[i] = vec4<f32>(0.0);
        return;
    }
    var gt: f32;
    if (MEAN) { gt = g[0] / stats_in[1]; } else { gt = g[row]; }
    let prob = exp(logits4[i] - vec4<f32>(lse_in[row]));
    let hit = vec4<u32>(j, j + 1u, j + 2u, j + 3u) == vec4<u32>(y);
    let q = select(vec4<f32>(0.0), vec4<f32>(1.0 - p.eps), hit) + vec4<f32>(p.eps / f32(p.v));
    dlogits4[i] = (prob - q) * gt;
}
