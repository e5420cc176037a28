// Batched f32 matrix product, either operand transposed, with an optional bias row:
//   C[b] = alpha * op(A[b]) @ op(B[b]) + bias + beta * C[b]   (bias (N), added to every row)
//   op(A) (M, K): A is (B, M, K), or (B, K, M) when TRANS_A
//   op(B) (K, N): B is (B, K, N), or (B, N, K) when TRANS_B
//   C (B, M, N) contiguous. A batch stride of 0 broadcasts that operand.
//
// Tiling: a workgroup of 256 threads computes a 128 x 128 tile of C, stepping through K
// BK at a time. Each step stages a 128 x BK slab of op(A) and a BK x 128 slab of op(B) in
// workgroup memory, both k-major so that a vec4 read gives 4 consecutive rows (A) or
// columns (B). Thread (tx, ty) owns an 8 x 8 block of C: rows {4ty..4ty+3, 64+4ty..+3},
// columns {4tx..4tx+3, 64+4tx..+3}. The split halves keep a warp's shared reads on
// distinct banks. Per k it does 4 vec4 loads from workgroup memory for 64 FMAs.
// VEC: global loads as vec4 (host guarantees the contiguous dimension of each operand
// and the batch strides are multiples of 4); otherwise scalar loads with bounds checks.
// The next slab is loaded from global memory into registers while the current one is
// multiplied (prefetch), so load latency overlaps the FMAs.
// The accumulators are 16 named vec4s, not an array: an array indexed by a loop counter
// can end up in local memory instead of registers (it did: 1.8 TFLOP/s on an H200).
// Grid: (ceil(N/128), ceil(M/128), batch).
//
// Split-K (host side, for A^T B with few output tiles and a long K, e.g. weight gradients
// dW = dY^T X): K is cut into S chunks (the last one shorter where S does not divide K:
// k_last) run as a batch of S products into partials (S, M, N), then splitk_sum adds the S partials in order s = 0, 1, ... (+ beta C). Fixed
// order: same bits on every run. Grid of splitk_sum: cover M*N threads, 256 per workgroup.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    stride_a: u32,   // elements between batches of A (0: broadcast)
    stride_b: u32,
    stride_c: u32,
    alpha: f32,
    beta: f32,       // 0: C is overwritten, never read
    bias: u32,       // 1: add bias[n] to column n (0: the binding is a stand-in, not read)
    k_last: u32,     // split-K (A^T B): the last batch slice's k where shorter; 0: p.k for all
    pad1: u32,
    pad2: u32,
}

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override VEC: bool = false;
override BK: u32 = 8u;         // k depth of a slab: 8 or 16

const BM: u32 = 128u;
const BN: u32 = 128u;
const NT: u32 = 256u;          // threads per workgroup

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> a4: array<vec4<f32>>;   // same buffer as a
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read> b4: array<vec4<f32>>;   // same buffer as b
@group(0) @binding(5) var<storage, read_write> c: array<f32>;
@group(0) @binding(6) var<storage, read> parts: array<f32>;      // split-K partials (S, M, N)
@group(0) @binding(7) var<storage, read> bias: array<f32>;       // (N)

var<workgroup> As: array<vec4<f32>, BK * BM / 4u>;   // As[k * BM/4 + m/4][m % 4]
var<workgroup> Bs: array<vec4<f32>, BK * BN / 4u>;   // Bs[k * BN/4 + n/4][n % 4]

// 4 consecutive elements of a row-major (rows, cols) matrix at base, (r, col..col+3); zero
// outside. In VEC mode cols % 4 == 0 and col % 4 == 0, so the 4 are all in or all out.
fn load_a(base: u32, r: u32, col: u32, rows: u32, cols: u32) -> vec4<f32> {
    if (r >= rows || col >= cols) { return vec4<f32>(0.0); }
    let i = base + r * cols + col;
    if (VEC) { return a4[i / 4u]; }
    return vec4<f32>(a[i], select(0.0, a[i + 1u], col + 1u < cols),
                     select(0.0, a[i + 2u], col + 2u < cols), select(0.0, a[i + 3u], col + 3u < cols));
}

fn load_b(base: u32, r: u32, col: u32, rows: u32, cols: u32) -> vec4<f32> {
    if (r >= rows || col >= cols) { return vec4<f32>(0.0); }
    let i = base + r * cols + col;
    if (VEC) { return b4[i / 4u]; }
    return vec4<f32>(b[i], select(0.0, b[i + 1u], col + 1u < cols),
                     select(0.0, b[i + 2u], col + 2u < cols), select(0.0, b[i + 3u], col + 3u < cols));
}

// Load slot q (0 .. BM*BK/4) of the op(A) slab at k0: 4 values, and where they go.
fn fetch_a(q: u32, m0: u32, k0: u32, off: u32, kz: u32) -> vec4<f32> {
    if (TRANS_A) {   // A stored (K, M): 4 consecutive m of one k
        return load_a(off, k0 + q / (BM / 4u), m0 + (q % (BM / 4u)) * 4u, kz, p.m);
    }
    // A stored (M, K): 4 consecutive k of one m
    return load_a(off, m0 + q / (BK / 4u), k0 + (q % (BK / 4u)) * 4u, p.m, p.k);
}

fn stash_a(q: u32, v: vec4<f32>) {
    if (TRANS_A) {
        As[q] = v;   // q = kk * BM/4 + m/4 already
    } else {
        let row = q / (BK / 4u);
        let kq = (q % (BK / 4u)) * 4u;
        As[(kq + 0u) * (BM / 4u) + row / 4u][row % 4u] = v.x;
        As[(kq + 1u) * (BM / 4u) + row / 4u][row % 4u] = v.y;
        As[(kq + 2u) * (BM / 4u) + row / 4u][row % 4u] = v.z;
        As[(kq + 3u) * (BM / 4u) + row / 4u][row % 4u] = v.w;
    }
}

fn fetch_b(q: u32, n0: u32, k0: u32, off: u32, kz: u32) -> vec4<f32> {
    if (TRANS_B) {   // B stored (N, K): 4 consecutive k of one n
        return load_b(off, n0 + q / (BK / 4u), k0 + (q % (BK / 4u)) * 4u, p.n, p.k);
    }
    // B stored (K, N): 4 consecutive n of one k
    return load_b(off, k0 + q / (BN / 4u), n0 + (q % (BN / 4u)) * 4u, kz, p.n);
}

fn stash_b(q: u32, v: vec4<f32>) {
    if (TRANS_B) {
        let row = q / (BK / 4u);
        let kq = (q % (BK / 4u)) * 4u;
        Bs[(kq + 0u) * (BN / 4u) + row / 4u][row % 4u] = v.x;
        Bs[(kq + 1u) * (BN / 4u) + row / 4u][row % 4u] = v.y;
        Bs[(kq + 2u) * (BN / 4u) + row / 4u][row % 4u] = v.z;
        Bs[(kq + 3u) * (BN / 4u) + row / 4u][row % 4u] = v.w;
    } else {
        Bs[q] = v;
    }
}

// Row m of C, columns nb..nb+3 and nb+64..nb+67: C = alpha * acc + bias + beta * C.
fn store_row(c_off: u32, m: u32, nb: u32, v0: vec4<f32>, v1: vec4<f32>) {
    if (m >= p.m) { return; }
    let row = c_off + m * p.n;
    for (var j = 0u; j < 8u; j++) {
        let n = nb + select(j, 60u + j, j >= 4u);   // nb+0..3, nb+64..67
        if (n < p.n) {
            var r = p.alpha * select(v0[j % 4u], v1[j % 4u], j >= 4u);
            if (p.bias != 0u) { r += bias[n]; }
            if (p.beta != 0.0) { r += p.beta * c[row + n]; }
            c[row + n] = r;
        }
    }
}

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) tid: u32) {
    // This slice's k: split-K's last chunk may be shorter (A^T B: k only bounds the rows).
    let kz = select(p.k, p.k_last, p.k_last != 0u && wid.z + 1u == nwg.z);
    let tx = tid % 16u;
    let ty = tid / 16u;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let a_off = wid.z * p.stride_a;
    let b_off = wid.z * p.stride_b;
    let c_off = wid.z * p.stride_c;
    let two = BK == 16u;   // two load slots per thread per operand

    // Row i of the 8 x 8 block, column half h: c{i}{h}.
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0);
    var c40 = vec4<f32>(0.0); var c41 = vec4<f32>(0.0);
    var c50 = vec4<f32>(0.0); var c51 = vec4<f32>(0.0);
    var c60 = vec4<f32>(0.0); var c61 = vec4<f32>(0.0);
    var c70 = vec4<f32>(0.0); var c71 = vec4<f32>(0.0);

    var pa0 = fetch_a(tid, m0, 0u, a_off, kz);
    var pb0 = fetch_b(tid, n0, 0u, b_off, kz);
    var pa1 = vec4<f32>(0.0);
    var pb1 = vec4<f32>(0.0);
    if (two) {
        pa1 = fetch_a(tid + NT, m0, 0u, a_off, kz);
        pb1 = fetch_b(tid + NT, n0, 0u, b_off, kz);
    }

    for (var k0 = 0u; k0 < kz; k0 += BK) {
        stash_a(tid, pa0);
        stash_b(tid, pb0);
        if (two) {
            stash_a(tid + NT, pa1);
            stash_b(tid + NT, pb1);
        }
        workgroupBarrier();
        let k1 = k0 + BK;
        if (k1 < kz) {
            pa0 = fetch_a(tid, m0, k1, a_off, kz);
            pb0 = fetch_b(tid, n0, k1, b_off, kz);
            if (two) {
                pa1 = fetch_a(tid + NT, m0, k1, a_off, kz);
                pb1 = fetch_b(tid + NT, n0, k1, b_off, kz);
            }
        }
        for (var kk = 0u; kk < BK; kk++) {
            let a0 = As[kk * (BM / 4u) + ty];
            let a1 = As[kk * (BM / 4u) + 16u + ty];
            let b0 = Bs[kk * (BN / 4u) + tx];
            let b1 = Bs[kk * (BN / 4u) + 16u + tx];
            c00 = fma(vec4<f32>(a0.x), b0, c00); c01 = fma(vec4<f32>(a0.x), b1, c01);
            c10 = fma(vec4<f32>(a0.y), b0, c10); c11 = fma(vec4<f32>(a0.y), b1, c11);
            c20 = fma(vec4<f32>(a0.z), b0, c20); c21 = fma(vec4<f32>(a0.z), b1, c21);
            c30 = fma(vec4<f32>(a0.w), b0, c30); c31 = fma(vec4<f32>(a0.w), b1, c31);
            c40 = fma(vec4<f32>(a1.x), b0, c40); c41 = fma(vec4<f32>(a1.x), b1, c41);
            c50 = fma(vec4<f32>(a1.y), b0, c50); c51 = fma(vec4<f32>(a1.y), b1, c51);
            c60 = fma(vec4<f32>(a1.z), b0, c60); c61 = fma(vec4<f32>(a1.z), b1, c61);
            c70 = fma(vec4<f32>(a1.w), b0, c70); c71 = fma(vec4<f32>(a1.w), b1, c71);
        }
        workgroupBarrier();
    }

    let nb = n0 + 4u * tx;
    let r0 = m0 + 4u * ty;
    let r1 = m0 + 64u + 4u * ty;
    store_row(c_off, r0 + 0u, nb, c00, c01);
    store_row(c_off, r0 + 1u, nb, c10, c11);
    store_row(c_off, r0 + 2u, nb, c20, c21);
    store_row(c_off, r0 + 3u, nb, c30, c31);
    store_row(c_off, r1 + 0u, nb, c40, c41);
    store_row(c_off, r1 + 1u, nb, c50, c51);
    store_row(c_off, r1 + 2u, nb, c60, c61);
    store_row(c_off, r1 + 3u, nb, c70, c71);
}

// c = parts[0] + parts[1] + ... + parts[p.k - 1] (+ bias, + beta c); p.k is the split
// count here.
@compute @workgroup_size(256)
fn splitk_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let total = p.m * p.n;
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= total) {
        return;
    }
    var s = 0.0;
    for (var j = 0u; j < p.k; j++) {
        s += parts[j * total + i];
    }
    if (p.bias != 0u) {
        s += bias[i % p.n];
    }
    if (p.beta != 0.0) {
        s += p.beta * c[i];
    }
    c[i] = s;
}

// matmul_coop.wgsl's SPLIT products (f16x3) scale each operand by its largest magnitude:
// out[y * 256 + x] = the largest |value| (as f32 bits: for values >= 0 their order is the
// u32 order, infinity and NaN above every finite one) among workgroup x's share of operand
// y (0: A, read as p.m vec4s; 1: B, p.n vec4s). Grid: (256, 2).
@group(0) @binding(8) var<storage, read_write> maxes_out: array<u32>;
var<workgroup> wmax: atomic<u32>;

@compute @workgroup_size(256)
fn absmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        atomicStore(&wmax, 0u);
    }
    workgroupBarrier();
    // Four loads in flight a thread: vec4s i, i + S, i + 2S, i + 3S (S = 65,536).
    var m = 0u;
    let stride = 256u * 256u;
    let n = select(p.n, p.m, wid.y == 0u);
    for (var i = wid.x * 256u + lid; i < n; i += 4u * stride) {
        var v: array<vec4<f32>, 4>;
        for (var j = 0u; j < 4u; j++) {
            let at = i + j * stride;
            if (at < n) {
                if (wid.y == 0u) {
                    v[j] = a4[at];
                } else {
                    v[j] = b4[at];
                }
            } else {
                v[j] = vec4<f32>(0.0);
            }
        }
        for (var j = 0u; j < 4u; j++) {
            let u = bitcast<vec4<u32>>(abs(v[j]));
            m = max(m, max(max(u.x, u.y), max(u.z, u.w)));
        }
    }
    atomicMax(&wmax, m);
    workgroupBarrier();
    if (lid == 0u) {
        maxes_out[wid.y * 256u + wid.x] = atomicLoad(&wmax);
    }
}
