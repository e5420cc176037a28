// quant.wgsl's tiled product (y = x @ W^T, W in its GGUF blocks) on cooperative matrices
// (tensor cores), for adapters with EXPERIMENTAL_COOPERATIVE_MATRIX, SHADER_F16 and
// subgroups of 32; the block decoding (value4, TYPE, binding 1) is quant_blocks.wgsl's,
// put before this file. Rows of W are a multiple of 4 long (k).
//
//   qmatmul_coop  dst (m, n) = rowf * (xh @ W^T) (xh and rowf from quant.wgsl's x_half:
//            x, after the fused norm, as f16, scaled by a power of two where f16 cannot
//            hold a row), RESIDUAL: + res. SPLITK: workgroup z sums slice z of k into
//            partial tiles at dst[z] (splits, m, n) for quant.wgsl's splitk_sum (no
//            RESIDUAL). (SwiGLU / GeGLU: the product, then quant.wgsl's glu_rows.)
//                                   grid (ceil(n / 128), ceil(m / 128), splits)
//            TRANS_W: dst (m, n) = rowf * (xh @ W) + res, W (k, n) as stored (qmatmul_t's
//            dX = dY W, n W's columns): W staged by rows ([k][n]), see fetch_wt.
//   qmatmul_coop_skinny  the same with tiles of 16, 32 or 64 rows (few rows of x: batched
//            decode steps; at the end of the file)
//
// Tiling as matmul_coop.wgsl's (its TRANS_B case): a workgroup of 128 threads (4
// subgroups of 32) computes a 128 x 128 tile, stepping through k 32 at a time; each step
// stages xh's 128 x 32 (row-major) and W's 128 x 32 (decoded by value4 on the way, rounded
// to f16; row-major, i.e. W^T column-major) in workgroup memory, rows padded by 8 halves;
// the next step's values wait in registers. Subgroup w owns rows 64 (w / 2).. and columns
// 64 (w % 2).. of the tile: 4 x 4 accumulators of 16 x 16 in f32. A whole tile with rows
// of factor 1, no residual and no split is stored straight from the accumulators; others
// go through the subgroup's 16 x 16 scratch
// (a larger scratch, 4 accumulators a barrier pair, made every product slower on the
// H200, docs/benchmarks.md session 21). Sums run in a fixed order: the same inputs give
// the same bits.
// Against the exact product, each term carries f16's rounding of x and of W's value
// (2^-11 relative each).

enable f16;
enable wgpu_cooperative_matrix;

struct Params {
    n: u32,    // outputs per row of x (rows of W)
    m: u32,    // rows of x
    k: u32,    // row length (a multiple of 4)
    splits: u32,   // SPLITK: slices of k
}

override RESIDUAL: bool = false;
override SPLITK: bool = false;
override TRANS_W: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
// W's blocks (1 and 13, quant_blocks.wgsl), the output, xh, rowf, the residual.
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> xh: array<vec4<f16>>;
@group(0) @binding(4) var<storage, read> rowf: array<f32>;
@group(0) @binding(5) var<storage, read> res: array<f32>;
const T: u32 = 128u;    // tile of the output
const BK: u32 = 32u;    // k a step
const SK: u32 = 10u;    // stride of a staged row (BK + 8 halves, in vec4s)

var<workgroup> sa: array<vec4<f16>, 1280>;   // xh [m][k]: T rows of SK
var<workgroup> sb: array<vec4<f16>, 1280>;   // W [n][k]: T rows of SK
var<workgroup> scratch: array<f32, 1024>;   // 16 x 16 a subgroup

// Slot q (0..1024) of a step at k0: 4 consecutive k of one row (zero outside).
fn fetch_a(q: u32, m0: u32, k0: u32, kz: u32) -> vec4<f16> {
    let m = m0 + q / 8u;
    let kk = k0 + (q % 8u) * 4u;
    if (m < p.m && kk < kz) {
        return xh[(m * p.k + kk) / 4u];
    }
    return vec4<f16>(0.0);
}

fn fetch_b(q: u32, n0: u32, k0: u32, kz: u32) -> vec4<f16> {
    let n = n0 + q / 8u;
    let kk = k0 + (q % 8u) * 4u;
    if (n < p.n && kk < kz) {
        return vec4<f16>(value4(n * p.k + kk));
    }
    return vec4<f16>(0.0);
}

fn stash(q: u32) -> u32 {
    return (q / 8u) * SK + q % 8u;
}

// RAW types (quant_blocks.wgsl): thread t takes row n0 + t of W's tile, a step's 32
// values of it being one block (or one K-quant sub-block): it fetches the block's words
// for the next step into registers (fetch_raw) before the step's products and decodes them
// into the staging row after (raw_value4), so the loads' latency hides behind the
// products and the scales are decoded once a run. Other types decode 4 values a slot as
// they are fetched (value4).
fn fetch_w_raw(n: u32, k0: u32, kz: u32) -> array<vec4<u32>, RAW_V4> {
    if (n >= p.n || k0 >= kz) {
        return array<vec4<u32>, RAW_V4>();   // zeros decode to zeros
    }
    return fetch_raw(n * p.k + k0);
}

// TRANS_W (qmatmul_t's dX = dY W with W as stored: outputs are W's columns, k runs over
// its rows): thread t stages W's row k0 + t / 4, columns n0 + 32 (t % 4) .. + 32 (one run
// of 32, whole in a block) into row t / 4 of sb as [k][n], rows of SN vec4s; the products
// load W's fragments row-major from there.
const SN: u32 = 34u;   // stride of a TRANS_W staged row (128 + 8 halves, in vec4s)

fn fetch_wt_raw(tid: u32, n0: u32, k0: u32, kz: u32) -> array<vec4<u32>, RAW_V4> {
    let j = k0 + tid / 4u;
    let c = n0 + 32u * (tid % 4u);
    if (j >= kz || c >= p.n) {
        return array<vec4<u32>, RAW_V4>();
    }
    return fetch_raw(j * p.n + c);
}

fn fetch_wt(tid: u32, i: u32, n0: u32, k0: u32, kz: u32) -> vec4<f16> {
    let j = k0 + tid / 4u;
    let c = n0 + 32u * (tid % 4u) + 4u * i;
    if (j < kz && c < p.n) {
        return vec4<f16>(value4(j * p.n + c));
    }
    return vec4<f16>(0.0);
}

// The run thread t stages at k0: its place in a K-quant block.
fn wt_run(tid: u32, n0: u32, k0: u32) -> u32 {
    return (((k0 + tid / 4u) * p.n + n0 + 32u * (tid % 4u)) % 256u) / 32u;
}

// Where thread t's 4 values i of its run go in sb.
fn wt_stash(tid: u32, i: u32) -> u32 {
    return (tid / 4u) * SN + (tid % 4u) * 8u + i;
}

// Accumulator (rows r0.., columns c0.. of the output) through the subgroup's
// scratch: lane l takes elements 8 l .. 8 l + 7 of the 16 x 16 block (half a row).
fn put(acc: coop_mat16x16<f32, C>, w: u32, lane: u32, r0: u32, c0: u32, z: u32) {
    coopStoreT(acc, &scratch[w * 256u], 16u);
    workgroupBarrier();
    let i0 = lane * 8u;
    let r = r0 + i0 / 16u;
    if (r < p.m) {
        let f = rowf[r];
        for (var e = 0u; e < 8u; e++) {
            let col = c0 + i0 % 16u + e;
            let v = scratch[w * 256u + i0 + e] * f;
            if (col < p.n) {
                if (SPLITK) {
                    dst[(z * p.m + r) * p.n + col] = v;
                } else if (RESIDUAL) {
                    dst[r * p.n + col] = res[r * p.n + col] + v;
                } else {
                    dst[r * p.n + col] = v;
                }
            }
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(128)
fn qmatmul_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let m0 = wid.y * T;
    let n0 = wid.x * T;
    // This workgroup's slice of k: [kb0, kz).
    var kb0 = 0u;
    var kz = p.k;
    if (SPLITK) {
        let per = (p.k + p.splits * BK - 1u) / (p.splits * BK) * BK;
        kb0 = min(p.k, wid.z * per);
        kz = min(p.k, kb0 + per);
    }
    let w = tid / 32u;
    let lane = tid % 32u;
    let wr = (w / 2u) * 64u;   // the subgroup's rows and columns within the tile
    let wc = (w % 2u) * 64u;

    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
    var c20: coop_mat16x16<f32, C>;
    var c21: coop_mat16x16<f32, C>;
    var c22: coop_mat16x16<f32, C>;
    var c23: coop_mat16x16<f32, C>;
    var c30: coop_mat16x16<f32, C>;
    var c31: coop_mat16x16<f32, C>;
    var c32: coop_mat16x16<f32, C>;
    var c33: coop_mat16x16<f32, C>;
    // Declared, then set, as matmul_coop.wgsl does.
    c00 = coop_mat16x16<f32, C>();
    c01 = coop_mat16x16<f32, C>();
    c02 = coop_mat16x16<f32, C>();
    c03 = coop_mat16x16<f32, C>();
    c10 = coop_mat16x16<f32, C>();
    c11 = coop_mat16x16<f32, C>();
    c12 = coop_mat16x16<f32, C>();
    c13 = coop_mat16x16<f32, C>();
    c20 = coop_mat16x16<f32, C>();
    c21 = coop_mat16x16<f32, C>();
    c22 = coop_mat16x16<f32, C>();
    c23 = coop_mat16x16<f32, C>();
    c30 = coop_mat16x16<f32, C>();
    c31 = coop_mat16x16<f32, C>();
    c32 = coop_mat16x16<f32, C>();
    c33 = coop_mat16x16<f32, C>();

    var pa: array<vec4<f16>, 8>;
    var pb: array<vec4<f16>, 8>;
    var raw: array<vec4<u32>, RAW_V4>;
    for (var i = 0u; i < 8u; i++) {
        pa[i] = fetch_a(tid + 128u * i, m0, kb0, kz);
        if (!RAW) {
            if (TRANS_W) {
                pb[i] = fetch_wt(tid, i, n0, kb0, kz);
            } else {
                pb[i] = fetch_b(tid + 128u * i, n0, kb0, kz);
            }
        }
    }
    if (RAW) {
        if (TRANS_W) {
            raw = fetch_wt_raw(tid, n0, kb0, kz);
        } else {
            raw = fetch_w_raw(n0 + tid, kb0, kz);
        }
    }
    for (var k0 = kb0; k0 < kz; k0 += BK) {
        for (var i = 0u; i < 8u; i++) {
            sa[stash(tid + 128u * i)] = pa[i];
        }
        if (RAW && TRANS_W) {
            let run = wt_run(tid, n0, k0);
            for (var e = 0u; e < 8u; e++) {
                sb[wt_stash(tid, e)] = vec4<f16>(raw_value4(raw, e, run));
            }
        } else if (RAW) {
            for (var e = 0u; e < 8u; e++) {
                sb[tid * SK + e] = vec4<f16>(raw_value4(raw, e, (k0 % 256u) / 32u));
            }
        } else if (TRANS_W) {
            for (var i = 0u; i < 8u; i++) {
                sb[wt_stash(tid, i)] = pb[i];
            }
        } else {
            for (var i = 0u; i < 8u; i++) {
                sb[stash(tid + 128u * i)] = pb[i];
            }
        }
        workgroupBarrier();
        let k1 = k0 + BK;
        if (k1 < kz) {
            for (var i = 0u; i < 8u; i++) {
                pa[i] = fetch_a(tid + 128u * i, m0, k1, kz);
                if (!RAW) {
                    if (TRANS_W) {
                pb[i] = fetch_wt(tid, i, n0, k1, kz);
            } else {
                pb[i] = fetch_b(tid + 128u * i, n0, k1, kz);
            }
                }
            }
            if (RAW) {
                if (TRANS_W) {
                    raw = fetch_wt_raw(tid, n0, k1, kz);
                } else {
                    raw = fetch_w_raw(n0 + tid, k1, kz);
                }
            }
        }
        for (var kb = 0u; kb < BK / 4u; kb += 4u) {   // 16 k a pass, in vec4s
            var a0: coop_mat16x16<f16, A>;
            var a1: coop_mat16x16<f16, A>;
            var a2: coop_mat16x16<f16, A>;
            var a3: coop_mat16x16<f16, A>;
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            var b2: coop_mat16x16<f16, B>;
            var b3: coop_mat16x16<f16, B>;
            a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[wr * SK + kb], SK);
            a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 16u) * SK + kb], SK);
            a2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 32u) * SK + kb], SK);
            a3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[(wr + 48u) * SK + kb], SK);
            if (TRANS_W) {
                // W's rows k0 + 4 kb .. + 16 (rows of sb), columns wc + 16 c .. + 16.
                let bt = 4u * kb * SN + wc / 4u;
                b0 = coopLoadT<coop_mat16x16<f16, B>>(&sb[bt], SN);
                b1 = coopLoadT<coop_mat16x16<f16, B>>(&sb[bt + 4u], SN);
                b2 = coopLoadT<coop_mat16x16<f16, B>>(&sb[bt + 8u], SN);
                b3 = coopLoadT<coop_mat16x16<f16, B>>(&sb[bt + 12u], SN);
            } else {
                b0 = coopLoad<coop_mat16x16<f16, B>>(&sb[wc * SK + kb], SK);
                b1 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 16u) * SK + kb], SK);
                b2 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 32u) * SK + kb], SK);
                b3 = coopLoad<coop_mat16x16<f16, B>>(&sb[(wc + 48u) * SK + kb], SK);
            }
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c22 = coopMultiplyAdd(a2, b2, c22);
            c23 = coopMultiplyAdd(a2, b3, c23);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
            c32 = coopMultiplyAdd(a3, b2, c32);
            c33 = coopMultiplyAdd(a3, b3, c33);
        }
        workgroupBarrier();
    }

    // Straight to the output: a whole tile, no residual or split, every row's
    // rowf 1 (thread 0 looks; the flag is read uniformly through the scratch). (Sums
    // started from the residual, to store residual tiles straight too, measured no faster
    // on the H200: 42.8 vs 42.4 ms for the 8B's o and down.)
    if (tid == 0u) {
        var ones = 1.0;
        for (var i = 0u; i < T; i++) {
            if (m0 + i < p.m && rowf[m0 + i] != 1.0) {
                ones = 0.0;
            }
        }
        scratch[0] = ones;
    }
    let ones = workgroupUniformLoad(&scratch[0]);
    workgroupBarrier();   // read by all before `put` may write the scratch
    // (`&`, not `&&`: naga takes a short-circuit's value as non-uniform.)
    let whole = (m0 + T <= p.m) & (n0 + T <= p.n) & (p.n % 4u == 0u);
    let straight = whole & (ones == 1.0) & !RESIDUAL & !SPLITK;
    let r0 = m0 + wr;
    let c0 = n0 + wc;
    if (straight) {
        // Addresses as named values: naga's SPIR-V writer panics on expressions written
        // inside coopStoreT's arguments.
        let n = p.n;
        let at = r0 * n + c0;   // the output's element (r0, c0), then rows 16 apart
        let r16 = 16u * n;
        let a00 = at + 0u * r16 + 0u;
        let a01 = at + 0u * r16 + 16u;
        let a02 = at + 0u * r16 + 32u;
        let a03 = at + 0u * r16 + 48u;
        let a10 = at + 1u * r16 + 0u;
        let a11 = at + 1u * r16 + 16u;
        let a12 = at + 1u * r16 + 32u;
        let a13 = at + 1u * r16 + 48u;
        let a20 = at + 2u * r16 + 0u;
        let a21 = at + 2u * r16 + 16u;
        let a22 = at + 2u * r16 + 32u;
        let a23 = at + 2u * r16 + 48u;
        let a30 = at + 3u * r16 + 0u;
        let a31 = at + 3u * r16 + 16u;
        let a32 = at + 3u * r16 + 32u;
        let a33 = at + 3u * r16 + 48u;
        coopStoreT(c00, &dst[a00], n);
        coopStoreT(c01, &dst[a01], n);
        coopStoreT(c02, &dst[a02], n);
        coopStoreT(c03, &dst[a03], n);
        coopStoreT(c10, &dst[a10], n);
        coopStoreT(c11, &dst[a11], n);
        coopStoreT(c12, &dst[a12], n);
        coopStoreT(c13, &dst[a13], n);
        coopStoreT(c20, &dst[a20], n);
        coopStoreT(c21, &dst[a21], n);
        coopStoreT(c22, &dst[a22], n);
        coopStoreT(c23, &dst[a23], n);
        coopStoreT(c30, &dst[a30], n);
        coopStoreT(c31, &dst[a31], n);
        coopStoreT(c32, &dst[a32], n);
        coopStoreT(c33, &dst[a33], n);
        return;
    }
    let z = wid.z;
    put(c00, w, lane, r0, c0, z);
    put(c01, w, lane, r0, c0 + 16u, z);
    put(c02, w, lane, r0, c0 + 32u, z);
    put(c03, w, lane, r0, c0 + 48u, z);
    put(c10, w, lane, r0 + 16u, c0, z);
    put(c11, w, lane, r0 + 16u, c0 + 16u, z);
    put(c12, w, lane, r0 + 16u, c0 + 32u, z);
    put(c13, w, lane, r0 + 16u, c0 + 48u, z);
    put(c20, w, lane, r0 + 32u, c0, z);
    put(c21, w, lane, r0 + 32u, c0 + 16u, z);
    put(c22, w, lane, r0 + 32u, c0 + 32u, z);
    put(c23, w, lane, r0 + 32u, c0 + 48u, z);
    put(c30, w, lane, r0 + 48u, c0, z);
    put(c31, w, lane, r0 + 48u, c0 + 16u, z);
    put(c32, w, lane, r0 + 48u, c0 + 32u, z);
    put(c33, w, lane, r0 + 48u, c0 + 48u, z);
}

// ---- qmatmul_coop_skinny: few rows of x (batched decode steps, 2 .. 64) ----
// The same product with tiles of 16 SK_R rows (SK_R = 1, 2 or 4) by SK_N columns (32, 64
// or 128; SK_N threads, SK_N / 32 subgroups), so that W is decoded once per 16 SK_R rows
// of x, not once per 128 (most of them padding at these m): subgroup w owns columns
// 32 w .. + 32 of the tile and all its rows, SK_R x 2 accumulators. Each step stages xh's
// 16 SK_R x SK_BK and W's SK_N x SK_BK (SK_BK = 32, 64 or 128 k a step: with more, more
// of W's bytes are in flight a thread and fewer barriers a product; workgroup memory
// (16 SK_R + SK_N) (SK_BK + 8) halves + 4 KiB) as qmatmul_coop does, thread t decoding
// row t of W's tile (RAW types: SK_BK / 32 runs of it). Tiles of 16 or 32 rows keep two
// steps' values in registers, step s + 2's loads going out once step s is staged (on an
// H100 the 8B's gate/up at 32 rows took 0.235 ms with one step ahead and 0.215 with two,
// the 32-stream step 1,959 -> 2,094 tok/s); 64-row tiles keep one (two took their
// 64-stream step from 2,971 to 2,440 tok/s: docs/benchmarks.md, session 32).
// Every tile goes out through `put` (rowf, RESIDUAL, SPLITK as there). Per output, the
// same sums in the same order as qmatmul_coop with the same slices of k, at any SK_BK
// and SK_N (16 k a product, in order; k past the end adds zeros).
//                                   grid (ceil(n / SK_N), ceil(m / (16 SK_R)), splits)
override SK_R: u32 = 1u;
override SK_BK: u32 = 32u;
override SK_N: u32 = 128u;             // columns of the tile (32, 64 or 128): threads, one a row of W
override SK_AHEAD2: bool = SK_R < 4u;  // two steps' loads in flight (else one)
override SKQ: u32 = SK_BK / 4u;        // slots (4 k) of a staged row
override SKS: u32 = SK_BK / 4u + 2u;   // stride of a staged row (SK_BK + 8 halves, in vec4s)

var<workgroup> ska: array<vec4<f16>, 16u * SK_R * SKS>;   // xh [m][k]: 16 SK_R rows of SKS
var<workgroup> skb: array<vec4<f16>, SK_N * SKS>;   // W [n][k]: SK_N rows of SKS

// Slot q of a skinny step at k0: 4 consecutive k of one row of x (zero outside).
fn skinny_a(q: u32, m0: u32, k0: u32, kz: u32) -> vec4<f16> {
    let m = m0 + q / SKQ;
    let kk = k0 + (q % SKQ) * 4u;
    if (m < p.m && kk < kz) {
        return xh[(m * p.k + kk) / 4u];
    }
    return vec4<f16>(0.0);
}

// The same for W's rows (types decoded as fetched, value4).
fn skinny_b(q: u32, n0: u32, k0: u32, kz: u32) -> vec4<f16> {
    let n = n0 + q / SKQ;
    let kk = k0 + (q % SKQ) * 4u;
    if (n < p.n && kk < kz) {
        return vec4<f16>(value4(n * p.k + kk));
    }
    return vec4<f16>(0.0);
}

fn skinny_stash(q: u32) -> u32 {
    return (q / SKQ) * SKS + q % SKQ;
}

// Run j (32 values) of thread t's row of W, staged at k0, decoded into its place.
fn skinny_raw(tid: u32, j: u32, k0: u32, r: array<vec4<u32>, RAW_V4>) {
    for (var e = 0u; e < 8u; e++) {
        skb[tid * SKS + 8u * j + e] = vec4<f16>(raw_value4(r, e, ((k0 + 32u * j) % 256u) / 32u));
    }
}

@compute @workgroup_size(SK_N)
fn qmatmul_coop_skinny(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let m0 = wid.y * 16u * SK_R;
    let n0 = wid.x * SK_N;
    var kb0 = 0u;
    var kz = p.k;
    if (SPLITK) {
        // Slices in whole 32s of k (BK), as qmatmul_coop's, whatever SK_BK: the same
        // slices, so the same sums, at every step size.
        let per = (p.k + p.splits * BK - 1u) / (p.splits * BK) * BK;
        kb0 = min(p.k, wid.z * per);
        kz = min(p.k, kb0 + per);
    }
    let w = tid / 32u;
    let lane = tid % 32u;
    let wc = w * 32u;   // the subgroup's columns within the tile
    let na = 16u * SK_R * SKQ / SK_N;   // x's slots a thread a step (1 .. 16)

    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c20: coop_mat16x16<f32, C>;
    var c21: coop_mat16x16<f32, C>;
    var c30: coop_mat16x16<f32, C>;
    var c31: coop_mat16x16<f32, C>;
    c00 = coop_mat16x16<f32, C>();
    c01 = coop_mat16x16<f32, C>();
    c10 = coop_mat16x16<f32, C>();
    c11 = coop_mat16x16<f32, C>();
    c20 = coop_mat16x16<f32, C>();
    c21 = coop_mat16x16<f32, C>();
    c30 = coop_mat16x16<f32, C>();
    c31 = coop_mat16x16<f32, C>();

    // The next step's values in registers: x's slots, and W's (runs of raw words, or
    // SKQ decoded slots); the q* the step after's (SK_AHEAD2), or the next step's
    // as they arrive. The fetches and hand-overs below are written out on purpose: the
    // same through a struct a step and helper functions took the 8B's gate/up from
    // 0.215 to 0.247 ms on the H100 (docs/benchmarks.md, session 32).
    var pa: array<vec4<f16>, 16>;
    var pb: array<vec4<f16>, 32>;
    var raw0: array<vec4<u32>, RAW_V4>;
    var raw1: array<vec4<u32>, RAW_V4>;
    var raw2: array<vec4<u32>, RAW_V4>;
    var raw3: array<vec4<u32>, RAW_V4>;
    var qa: array<vec4<f16>, 16>;
    var qb: array<vec4<f16>, 32>;
    var qraw0: array<vec4<u32>, RAW_V4>;
    var qraw1: array<vec4<u32>, RAW_V4>;
    var qraw2: array<vec4<u32>, RAW_V4>;
    var qraw3: array<vec4<u32>, RAW_V4>;
    for (var i = 0u; i < na; i++) {
        pa[i] = skinny_a(tid + SK_N * i, m0, kb0, kz);
    }
    if (RAW) {
        raw0 = fetch_w_raw(n0 + tid, kb0, kz);
        if (SK_BK > 32u) {
            raw1 = fetch_w_raw(n0 + tid, kb0 + 32u, kz);
        }
        if (SK_BK > 64u) {
            raw2 = fetch_w_raw(n0 + tid, kb0 + 64u, kz);
            raw3 = fetch_w_raw(n0 + tid, kb0 + 96u, kz);
        }
    } else {
        for (var i = 0u; i < SKQ; i++) {
            pb[i] = skinny_b(tid + SK_N * i, n0, kb0, kz);
        }
    }
    if (SK_AHEAD2 && kb0 + SK_BK < kz) {
        let k1 = kb0 + SK_BK;
        for (var i = 0u; i < na; i++) {
            qa[i] = skinny_a(tid + SK_N * i, m0, k1, kz);
        }
        if (RAW) {
            qraw0 = fetch_w_raw(n0 + tid, k1, kz);
            if (SK_BK > 32u) {
                qraw1 = fetch_w_raw(n0 + tid, k1 + 32u, kz);
            }
            if (SK_BK > 64u) {
                qraw2 = fetch_w_raw(n0 + tid, k1 + 64u, kz);
                qraw3 = fetch_w_raw(n0 + tid, k1 + 96u, kz);
            }
        } else {
            for (var i = 0u; i < SKQ; i++) {
                qb[i] = skinny_b(tid + SK_N * i, n0, k1, kz);
            }
        }
    }
    for (var k0 = kb0; k0 < kz; k0 += SK_BK) {
        if (!SK_AHEAD2 && k0 > kb0) {   // the step loaded during the last one's products
            pa = qa;
            if (RAW) {
                raw0 = qraw0;
                if (SK_BK > 32u) {
                    raw1 = qraw1;
                }
                if (SK_BK > 64u) {
                    raw2 = qraw2;
                    raw3 = qraw3;
                }
            } else {
                pb = qb;
            }
        }
        for (var i = 0u; i < na; i++) {
            ska[skinny_stash(tid + SK_N * i)] = pa[i];
        }
        if (RAW) {
            skinny_raw(tid, 0u, k0, raw0);
            if (SK_BK > 32u) {
                skinny_raw(tid, 1u, k0, raw1);
            }
            if (SK_BK > 64u) {
                skinny_raw(tid, 2u, k0, raw2);
                skinny_raw(tid, 3u, k0, raw3);
            }
        } else {
            for (var i = 0u; i < SKQ; i++) {
                skb[skinny_stash(tid + SK_N * i)] = pb[i];
            }
        }
        workgroupBarrier();
        if (SK_AHEAD2) {   // q* to p*, then the loads of the step after next
            pa = qa;
            if (RAW) {
                raw0 = qraw0;
                if (SK_BK > 32u) {
                    raw1 = qraw1;
                }
                if (SK_BK > 64u) {
                    raw2 = qraw2;
                    raw3 = qraw3;
                }
            } else {
                pb = qb;
            }
        }
        let k2 = k0 + select(1u, 2u, SK_AHEAD2) * SK_BK;
        if (k2 < kz) {
            for (var i = 0u; i < na; i++) {
                qa[i] = skinny_a(tid + SK_N * i, m0, k2, kz);
            }
            if (RAW) {
                qraw0 = fetch_w_raw(n0 + tid, k2, kz);
                if (SK_BK > 32u) {
                    qraw1 = fetch_w_raw(n0 + tid, k2 + 32u, kz);
                }
                if (SK_BK > 64u) {
                    qraw2 = fetch_w_raw(n0 + tid, k2 + 64u, kz);
                    qraw3 = fetch_w_raw(n0 + tid, k2 + 96u, kz);
                }
            } else {
                for (var i = 0u; i < SKQ; i++) {
                    qb[i] = skinny_b(tid + SK_N * i, n0, k2, kz);
                }
            }
        }
        for (var kb = 0u; kb < SKQ; kb += 4u) {   // 16 k a pass, in vec4s
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            b0 = coopLoad<coop_mat16x16<f16, B>>(&skb[wc * SKS + kb], SKS);
            b1 = coopLoad<coop_mat16x16<f16, B>>(&skb[(wc + 16u) * SKS + kb], SKS);
            var a0: coop_mat16x16<f16, A>;
            a0 = coopLoadT<coop_mat16x16<f16, A>>(&ska[kb], SKS);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            if (SK_R > 1u) {
                var a1: coop_mat16x16<f16, A>;
                a1 = coopLoadT<coop_mat16x16<f16, A>>(&ska[16u * SKS + kb], SKS);
                c10 = coopMultiplyAdd(a1, b0, c10);
                c11 = coopMultiplyAdd(a1, b1, c11);
            }
            if (SK_R > 2u) {
                var a2: coop_mat16x16<f16, A>;
                var a3: coop_mat16x16<f16, A>;
                a2 = coopLoadT<coop_mat16x16<f16, A>>(&ska[32u * SKS + kb], SKS);
                a3 = coopLoadT<coop_mat16x16<f16, A>>(&ska[48u * SKS + kb], SKS);
                c20 = coopMultiplyAdd(a2, b0, c20);
                c21 = coopMultiplyAdd(a2, b1, c21);
                c30 = coopMultiplyAdd(a3, b0, c30);
                c31 = coopMultiplyAdd(a3, b1, c31);
            }
        }
        workgroupBarrier();
    }
    let z = wid.z;
    let c0 = n0 + wc;
    put(c00, w, lane, m0, c0, z);
    put(c01, w, lane, m0, c0 + 16u, z);
    if (SK_R > 1u) {
        put(c10, w, lane, m0 + 16u, c0, z);
        put(c11, w, lane, m0 + 16u, c0 + 16u, z);
    }
    if (SK_R > 2u) {
        put(c20, w, lane, m0 + 32u, c0, z);
        put(c21, w, lane, m0 + 32u, c0 + 16u, z);
        put(c30, w, lane, m0 + 48u, c0, z);
        put(c31, w, lane, m0 + 48u, c0 + 16u, z);
    }
}
