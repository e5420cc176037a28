// Batched f32 matrix product, either operand transposed:
//   C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b]
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
// Grid: (ceil(N/128), ceil(M/128), batch).

struct Params {
    m: u32,
    n: u32,
    k: u32,
    stride_a: u32,   // elements between batches of A (0: broadcast)
    stride_b: u32,
    stride_c: u32,
    alpha: f32,
    beta: f32,       // 0: C is overwritten, never read
}

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override VEC: bool = false;

const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 8u;
const NT: u32 = 256u;          // threads per workgroup
const A_LOADS: u32 = BM * BK / (4u * NT);   // vec4 groups per thread per slab
const B_LOADS: u32 = BN * BK / (4u * NT);

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> a4: array<vec4<f32>>;   // same buffer as a
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read> b4: array<vec4<f32>>;   // same buffer as b
@group(0) @binding(5) var<storage, read_write> c: array<f32>;

var<workgroup> As: array<vec4<f32>, BK * BM / 4u>;   // As[k * BM/4 + m/4][m % 4]
var<workgroup> Bs: array<vec4<f32>, BK * BN / 4u>;   // Bs[k * BN/4 + n/4][n % 4]

// 4 consecutive elements of a row-major (rows, cols) matrix at base, (r, c..c+3); zero
// outside. Columns in range are all-or-nothing in VEC mode (cols % 4 == 0, c % 4 == 0).
fn load_a(base: u32, r: u32, col: u32, rows: u32, cols: u32) -> vec4<f32> {
    if (r >= rows || col >= cols) { return vec4<f32>(0.0); }
    let i = base + r * cols + col;
    if (VEC) { return a4[i / 4u]; }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (col + j < cols) { v[j] = a[i + j]; }
    }
    return v;
}

fn load_b(base: u32, r: u32, col: u32, rows: u32, cols: u32) -> vec4<f32> {
    if (r >= rows || col >= cols) { return vec4<f32>(0.0); }
    let i = base + r * cols + col;
    if (VEC) { return b4[i / 4u]; }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (col + j < cols) { v[j] = b[i + j]; }
    }
    return v;
}

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let tx = tid % 16u;
    let ty = tid / 16u;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let a_off = wid.z * p.stride_a;
    let b_off = wid.z * p.stride_b;
    let c_off = wid.z * p.stride_c;

    var acc: array<vec4<f32>, 16>;   // acc[2i + h]: row i of the block, column half h
    for (var i = 0u; i < 16u; i++) { acc[i] = vec4<f32>(0.0); }

    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        for (var l = 0u; l < A_LOADS; l++) {
            let q = tid + l * NT;
            if (TRANS_A) {
                // A stored (K, M): 4 consecutive m of one k.
                let kk = q / (BM / 4u);
                let mq = (q % (BM / 4u)) * 4u;
                As[kk * (BM / 4u) + mq / 4u] = load_a(a_off, k0 + kk, m0 + mq, p.k, p.m);
            } else {
                // A stored (M, K): 4 consecutive k of one m, scattered k-major.
                let row = q / (BK / 4u);
                let kq = (q % (BK / 4u)) * 4u;
                let v = load_a(a_off, m0 + row, k0 + kq, p.m, p.k);
                for (var j = 0u; j < 4u; j++) {
                    As[(kq + j) * (BM / 4u) + row / 4u][row % 4u] = v[j];
                }
            }
        }
        for (var l = 0u; l < B_LOADS; l++) {
            let q = tid + l * NT;
            if (TRANS_B) {
                // B stored (N, K): 4 consecutive k of one n, scattered k-major.
                let row = q / (BK / 4u);
                let kq = (q % (BK / 4u)) * 4u;
                let v = load_b(b_off, n0 + row, k0 + kq, p.n, p.k);
                for (var j = 0u; j < 4u; j++) {
                    Bs[(kq + j) * (BN / 4u) + row / 4u][row % 4u] = v[j];
                }
            } else {
                // B stored (K, N): 4 consecutive n of one k.
                let kk = q / (BN / 4u);
                let nq = (q % (BN / 4u)) * 4u;
                Bs[kk * (BN / 4u) + nq / 4u] = load_b(b_off, k0 + kk, n0 + nq, p.k, p.n);
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let a0 = As[kk * (BM / 4u) + ty];
            let a1 = As[kk * (BM / 4u) + 16u + ty];
            let b0 = Bs[kk * (BN / 4u) + tx];
            let b1 = Bs[kk * (BN / 4u) + 16u + tx];
            acc[0] = fma(vec4<f32>(a0.x), b0, acc[0]);
            acc[1] = fma(vec4<f32>(a0.x), b1, acc[1]);
            acc[2] = fma(vec4<f32>(a0.y), b0, acc[2]);
            acc[3] = fma(vec4<f32>(a0.y), b1, acc[3]);
            acc[4] = fma(vec4<f32>(a0.z), b0, acc[4]);
            acc[5] = fma(vec4<f32>(a0.z), b1, acc[5]);
            acc[6] = fma(vec4<f32>(a0.w), b0, acc[6]);
            acc[7] = fma(vec4<f32>(a0.w), b1, acc[7]);
            acc[8] = fma(vec4<f32>(a1.x), b0, acc[8]);
            acc[9] = fma(vec4<f32>(a1.x), b1, acc[9]);
            acc[10] = fma(vec4<f32>(a1.y), b0, acc[10]);
            acc[11] = fma(vec4<f32>(a1.y), b1, acc[11]);
            acc[12] = fma(vec4<f32>(a1.z), b0, acc[12]);
            acc[13] = fma(vec4<f32>(a1.z), b1, acc[13]);
            acc[14] = fma(vec4<f32>(a1.w), b0, acc[14]);
            acc[15] = fma(vec4<f32>(a1.w), b1, acc[15]);
        }
        workgroupBarrier();
    }

    for (var i = 0u; i < 8u; i++) {
        let m = m0 + select(4u * ty + i, 64u + 4u * ty + i - 4u, i >= 4u);
        if (m >= p.m) { continue; }
        for (var h = 0u; h < 2u; h++) {
            let v = acc[2u * i + h];
            let nb = n0 + 64u * h + 4u * tx;
            for (var j = 0u; j < 4u; j++) {
                let n = nb + j;
                if (n < p.n) {
                    let idx = c_off + m * p.n + n;
                    var r = p.alpha * v[j];
                    if (p.beta != 0.0) { r += p.beta * c[idx]; }
                    c[idx] = r;
                }
            }
        }
    }
}
