// 2-D convolution, NCHW, as implicit GEMM (no im2col buffer), forward and backward.
//   x (N, Cin, H, W), w (Cout, Cin/G, KH, KW), bias (Cout), y / dy (N, Cout, OH, OW)
//   iy = oy * sh - ph + ky * dh,  ix = ox * sw - pw + kx * dw  (zero outside the image)
// Per group g (Cin_g = Cin/G, Cout_g = Cout/G), each mode is C (M x P) = A (M x K) B (K x P):
//   MODE 0, forward:  M = Cout_g, P = N*OH*OW, K = Cin_g*KH*KW
//       A(co, (ci,ky,kx)) = w[g*Cout_g+co, ci, ky, kx]; B((ci,ky,kx), (n,oy,ox)) = x[n, g*Cin_g+ci, iy, ix]
//       y[n, g*Cout_g+co, oy, ox] = C + bias
//   MODE 1, dx (conv2d.rs runs a stride-1 dx as MODE 0 over dy with w flipped,
//   conv_flip_weights, and most strided ones as MODE 0 a residue class of dx's pixels,
//   conv_sub_weights + conv_interleave; this gather is the rest):
//                     M = Cin_g, P = N*H*W, K = Cout_g*KH*KW
//       A(ci, (co,ky,kx)) = w[g*Cout_g+co, ci, ky, kx]
//       B((co,ky,kx), (n,iy,ix)) = dy[n, g*Cout_g+co, oy, ox] where oy = (iy + ph - ky*dh) / sh
//       divides exactly and is in range (likewise ox), else 0. A gather: no atomics.
//   MODE 2, dw:       M = Cout_g, P = Cin_g*KH*KW, K = N*OH*OW, split into `splits` chunks
//       A(co, (n,oy,ox)) = dy[n, g*Cout_g+co, oy, ox]; B((n,oy,ox), (ci,ky,kx)) = x[n, g*Cin_g+ci, iy, ix]
//       partial[split, g*Cout_g+co, (ci,ky,kx)] = C over the chunk; conv_split_sum sums
//       the splits in order. Parallelism grows with N*OH*OW through the splits, and the
//       partition is fixed by the shape, so the result is the same bits on every run.
//   Split-K (modes 0 and 1, where the output has few tiles; the host picks): workgroup z's
//   split covers k in [split * chunk, + chunk) and writes its partial C at split * |out|
//   of a partials buffer; conv_split_sum adds the splits in order (then the bias). The
//   partition depends on the shape alone: the same bits on every run.
//   conv_bias_grad: one workgroup per co, db[co] = sum over n, oy, ox of dy (fixed-order tree).
// Tiling: 256 threads compute a 64 x 64 tile of C, k-slabs of 16 staged in workgroup memory
// (k-major, vec4 along M and P); thread (tx, ty) owns rows 4ty..4ty+3, columns 4tx..4tx+3.
// The next slab is fetched into registers while the current one is multiplied.
// Grid: linear over tiles_p * tiles_m * (G * splits) workgroups (2-D past 65535).

override WG: u32 = 256u;   // the kernels after conv_gemm

const T: u32 = 64u;    // tile edge
const BK: u32 = 16u;   // k slab

@group(0) @binding(6) var<storage, read> partial: array<f32>;
@group(0) @binding(7) var<storage, read_write> reduced: array<f32>;
@group(0) @binding(8) var<storage, read_write> db_out: array<f32>;

var<workgroup> As: array<vec4<f32>, BK * T / 4u>;   // As[k * 16 + m/4][m % 4]
var<workgroup> Bs: array<vec4<f32>, BK * T / 4u>;   // Bs[k * 16 + p/4][p % 4]
var<workgroup> red: array<f32, WG>;

// Element (m, k) of A for group g; 0 outside.
fn fetch_a(g: u32, m: u32, k: u32, kend: u32) -> f32 {
    if (m >= dim_m() || k >= kend) { return 0.0; }
    if (MODE == 0u) {
        return wt[(g * cout_g() + m) * dim_k() + k];
    }
    if (MODE == 1u) {
        let co = k / khw();
        return wt[((g * cout_g() + co) * cin_g() + m) * khw() + k % khw()];
    }
    let b = k / ohw();
    return dy[(b * p.cout + g * cout_g() + m) * ohw() + k % ohw()];
}

// What a column of B needs, decoded once per tile: (image or channel, y, x).
fn decode_col(col: u32) -> vec3<u32> {
    if (MODE == 0u) { let s = col % ohw(); return vec3<u32>(col / ohw(), s / p.ow, s % p.ow); }
    if (MODE == 1u) { let s = col % hw(); return vec3<u32>(col / hw(), s / p.w, s % p.w); }
    let r = col % khw();
    return vec3<u32>(col / khw(), r / p.kw, r % p.kw);
}

// Element (k, col) of B for group g; col decoded as above; 0 outside.
fn fetch_b(g: u32, k: u32, kend: u32, col: u32, cd: vec3<u32>) -> f32 {
    if (col >= dim_p() || k >= kend) { return 0.0; }
    if (MODE == 0u) {
        let ci = k / khw();
        let r = k % khw();
        let iy = i32(cd.y * p.sh + (r / p.kw) * p.dh) - i32(p.ph);
        let ix = i32(cd.z * p.sw + (r % p.kw) * p.dw) - i32(p.pw);
        if (iy < 0 || ix < 0 || iy >= i32(p.h) || ix >= i32(p.w)) { return 0.0; }
        return x[((cd.x * p.cin + g * cin_g() + ci) * p.h + u32(iy)) * p.w + u32(ix)];
    }
    if (MODE == 1u) {
        let co = k / khw();
        let r = k % khw();
        let ny = i32(cd.y + p.ph) - i32((r / p.kw) * p.dh);
        let nx = i32(cd.z + p.pw) - i32((r % p.kw) * p.dw);
        if (ny < 0 || nx < 0) { return 0.0; }
        let oy = u32(ny) / p.sh;
        let ox = u32(nx) / p.sw;
        if (oy * p.sh != u32(ny) || ox * p.sw != u32(nx) || oy >= p.oh || ox >= p.ow) { return 0.0; }
        return dy[((cd.x * p.cout + g * cout_g() + co) * p.oh + oy) * p.ow + ox];
    }
    // MODE 2: k = (n, oy, ox), column = (ci, ky, kx)
    let b = k / ohw();
    let s = k % ohw();
    let iy = i32((s / p.ow) * p.sh + cd.y * p.dh) - i32(p.ph);
    let ix = i32((s % p.ow) * p.sw + cd.z * p.dw) - i32(p.pw);
    if (iy < 0 || ix < 0 || iy >= i32(p.h) || ix >= i32(p.w)) { return 0.0; }
    return x[((b * p.cin + g * cin_g() + cd.x) * p.h + u32(iy)) * p.w + u32(ix)];
}

fn store_row(g: u32, split: u32, m: u32, c0: u32, v: vec4<f32>) {
    store(g, split, m, c0, v.x);
    store(g, split, m, c0 + 1u, v.y);
    store(g, split, m, c0 + 2u, v.z);
    store(g, split, m, c0 + 3u, v.w);
}

@compute @workgroup_size(256)
fn conv_gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) tid: u32) {
    var t = wid.x + wid.y * nwg.x;
    let tp = t % p.tiles_p;
    t /= p.tiles_p;
    let tm = t % p.tiles_m;
    let z = t / p.tiles_m;
    if (z >= p.groups * p.splits) { return; }   // uniform per workgroup, before any barrier
    let g = z / p.splits;
    let split = z % p.splits;
    let m0 = tm * T;
    let p0 = tp * T;
    let kstart = split * p.chunk;
    let kend = min(kstart + p.chunk, dim_k());

    // Loads: A slots m = tid/16 + 16r, k = tid%16; B slots k = tid/64 + 4r, column tid%64.
    let a_k = tid % 16u;
    let a_m = tid / 16u;
    let b_k = tid / 64u;
    let b_col = p0 + tid % 64u;
    let cd = decode_col(b_col);

    var pa = vec4<f32>(0.0);
    var pb = vec4<f32>(0.0);
    for (var r = 0u; r < 4u; r++) {
        pa[r] = fetch_a(g, m0 + a_m + 16u * r, kstart + a_k, kend);
        pb[r] = fetch_b(g, kstart + b_k + 4u * r, kend, b_col, cd);
    }

    let tx = tid % 16u;
    let ty = tid / 16u;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    for (var k0 = kstart; k0 < kend; k0 += BK) {
        for (var r = 0u; r < 4u; r++) {
            let m = a_m + 16u * r;
            As[a_k * 16u + m / 4u][m % 4u] = pa[r];
            let kk = b_k + 4u * r;
            Bs[kk * 16u + (tid % 64u) / 4u][tid % 4u] = pb[r];
        }
        workgroupBarrier();
        let k1 = k0 + BK;
        if (k1 < kend) {
            for (var r = 0u; r < 4u; r++) {
                pa[r] = fetch_a(g, m0 + a_m + 16u * r, k1 + a_k, kend);
                pb[r] = fetch_b(g, k1 + b_k + 4u * r, kend, b_col, cd);
            }
        }
        for (var kk = 0u; kk < BK; kk++) {
            let a = As[kk * 16u + ty];
            let b = Bs[kk * 16u + tx];
            c0 = fma(vec4<f32>(a.x), b, c0);
            c1 = fma(vec4<f32>(a.y), b, c1);
            c2 = fma(vec4<f32>(a.z), b, c2);
            c3 = fma(vec4<f32>(a.w), b, c3);
        }
        workgroupBarrier();
    }
    let mr = m0 + 4u * ty;
    let pc = p0 + 4u * tx;
    store_row(g, split, mr, pc, c0);
    store_row(g, split, mr + 1u, pc, c1);
    store_row(g, split, mr + 2u, pc, c2);
    store_row(g, split, mr + 3u, pc, c3);
}

// Split-K's sum (MODE 0: y, plus the bias; MODE 1: dx; MODE 2: dw): reduced[i] = sum
// over splits, in order, of partial[split, i]; one thread per element.
@compute @workgroup_size(WG)
fn conv_split_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    var per_split = p.n * p.cout * ohw();
    if (MODE == 1u) { per_split = p.n * p.cin * hw(); }
    if (MODE == 2u) { per_split = p.cout * cin_g() * khw(); }
    if (i >= per_split) { return; }
    var acc = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        acc += partial[s * per_split + i];
    }
    if (MODE == 0u && HAS_BIAS) {
        acc += bias[(i / ohw()) % p.cout];
    }
    reduced[i] = acc;
}

// A stride-1 dx as the forward convolution of dy with w flipped and transposed (conv2d.rs):
// wf (Cin, Cout_g, KH, KW), wf[g*Cin_g + ci, co, ky, kx] = w[g*Cout_g + co, ci, KH-1-ky, KW-1-kx].
// One thread per element of wf.
@compute @workgroup_size(WG)
fn conv_flip_weights(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    if (i >= p.cout * cin_g() * khw()) { return; }
    let r = i % khw();
    let co = (i / khw()) % cout_g();
    let cf = i / khw() / cout_g();
    let g = cf / cin_g();
    let ci = cf % cin_g();
    let ky = p.kh - 1u - r / p.kw;
    let kx = p.kw - 1u - r % p.kw;
    reduced[i] = wt[((g * cout_g() + co) * cin_g() + ci) * khw() + ky * p.kw + kx];
}

// A strided dx by residue classes (polyphase, conv2d.rs): the class (ry, rx)'s taps as a
// stride-1 kernel, flipped and transposed: ws (Cin, Cout_g, ty, tx),
// ws[g*Cin_g + ci, co, u, v] = w[g*Cout_g + co, ci, ky0 + (ty-1-u) sh, kx0 + (tx-1-v) sw].
@compute @workgroup_size(WG)
fn conv_sub_weights(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let taps = p.ty * p.tx;
    if (i >= p.cin * cout_g() * taps) { return; }
    let v = i % p.tx;
    let u = (i / p.tx) % p.ty;
    let co = (i / taps) % cout_g();
    let cf = i / taps / cout_g();
    let g = cf / cin_g();
    let ci = cf % cin_g();
    let ky = p.ky0 + (p.ty - 1u - u) * p.sh;
    let kx = p.kx0 + (p.tx - 1u - v) * p.sw;
    reduced[i] = wt[((g * cout_g() + co) * cin_g() + ci) * khw() + ky * p.kw + kx];
}

// dx[n, c, ry + sh j, rx + sw i] = class[n, c, r0y + j, r0x + i] over the class's j, i
// (class: N x Cin x th x tw, bound as `partial`).
@compute @workgroup_size(WG)
fn conv_interleave(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * WG + lid;
    let hj = (p.h - p.ry + p.sh - 1u) / p.sh;
    let wj = (p.w - p.rx + p.sw - 1u) / p.sw;
    if (i >= p.n * p.cin * hj * wj) { return; }
    let c = i % wj;
    let j = (i / wj) % hj;
    let nc = i / wj / hj;
    reduced[(nc * p.h + p.ry + p.sh * j) * p.w + p.rx + p.sw * c] =
        partial[(nc * p.th + p.r0y + j) * p.tw + p.r0x + c];
}

// db[co] = sum over (n, oy, ox) of dy; one workgroup per co, strided sums then a tree.
@compute @workgroup_size(WG)
fn conv_bias_grad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let co = wid.x + wid.y * nwg.x;
    let valid = co < p.cout;
    var s = 0.0;
    if (valid) {
        let total = p.n * ohw();
        for (var j = lid; j < total; j += WG) {
            s += dy[((j / ohw()) * p.cout + co) * ohw() + j % ohw()];
        }
    }
    red[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) { red[lid] += red[lid + stride]; }
        workgroupBarrier();
    }
    if (valid && lid == 0u) { db_out[co] = red[0]; }
}
