//! GPU dequantization of every supported GGUF type against the CPU dequantizer (itself
//! checked bit for bit against llama.cpp's gguf-py).

use half::{bf16, f16};

use super::{push, s, same_bits_as, twice, CheckResult};
use crate::check::{compare, Rng, Stats, Tolerance};
use crate::formats::gguf::GgmlType;
use crate::gpu::{Gpu, Tensor};
use crate::ops::quant::{
    chain_rounds, decode_rounds_x, dequantize, dequantize_runs, get_rows, qmatmul, qmatmul_chain,
    qmatmul_fused, qmatmul_t, quantize_x8, upload_blocks, uses_coop, x_half, Fuse, Next, QMatrix,
    MATVEC1_MIN_ROWS, MATVEC_MAX_ROWS, RAW_TYPES, SPLITK_MIN_COLS, SUPPORTED, XQ8_MIN_COLS,
};
use crate::reference::quant as cpu;

/// Byte offsets of the f16 scale fields in one block (random bytes there are often NaN).
pub fn scale_offsets(name: &str) -> &'static [usize] {
    match name {
        "Q4_0" | "Q5_0" | "Q8_0" => &[0],
        "Q4_1" | "Q5_1" | "Q4_K" | "Q5_K" => &[0, 2],
        "Q6_K" => &[208],
        _ => &[],
    }
}

/// Random blocks of type `name` holding `n` elements, scales finite.
pub fn random_blocks(name: &str, n: usize, rng: &mut Rng) -> Vec<u8> {
    let ty = GgmlType::from_name(name).expect("known type");
    let (per, bytes) = ty.block().expect("block layout");
    let (per, bytes) = (per as usize, bytes as usize);
    match name {
        "F32" => return rng.vec(n).iter().flat_map(|v| v.to_le_bytes()).collect(),
        "F16" => {
            return rng
                .vec(n)
                .iter()
                .flat_map(|v| f16::from_f32(*v * 4.0).to_le_bytes())
                .collect()
        }
        "BF16" => {
            return rng
                .vec(n)
                .iter()
                .flat_map(|v| bf16::from_f32(*v * 4.0).to_le_bytes())
                .collect()
        }
        _ => {}
    }
    let mut raw: Vec<u8> = (0..n / per * bytes).map(|_| rng.next_u64() as u8).collect();
    for block in raw.chunks_exact_mut(bytes) {
        for &off in scale_offsets(name) {
            block[off..off + 2].copy_from_slice(&f16::from_f32(rng.uniform() * 0.1).to_le_bytes());
        }
    }
    raw
}

pub(super) async fn checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    // Every type on a few blocks; Q8_0 and Q4_K past 65535 workgroups of 256; the
    // cooperative product's run decoding (RAW types) on a few blocks: (type, n, runs).
    let mut cases: Vec<(&str, usize, bool)> = SUPPORTED.iter().map(|&t| (t, 768, false)).collect();
    cases.push(("Q8_0", 65_540 * 256, false));
    cases.push(("Q4_K", 65_540 * 256, false));
    cases.extend(RAW_TYPES.iter().map(|&t| (t, 768, true)));
    for (i, &(name, n, runs)) in cases.iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(1900 + i as u64);
        let raw = random_blocks(name, n, &mut rng);
        let r = twice("dequantize", async || {
            let t = upload_blocks(gpu, &raw, ty, "raw")?;
            let y = gpu
                .run_async(|rec| match runs {
                    true => dequantize_runs(rec, &t, ty, &[n]),
                    false => dequantize(rec, &t, ty, &[n]),
                })
                .await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let res = (|| {
            let got = r.map_err(|e| e.to_string())?;
            let want = cpu::dequantize(ty, &raw, n).map_err(s)?;
            // Products of an f16 scale and small integers, minus a min: two roundings,
            // judged against the largest magnitude in each group of 32.
            let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let scale: Vec<f64> = want64
                .chunks(32)
                .flat_map(|g| {
                    let m = g.iter().fold(0.0f64, |a, v| a.max(v.abs()));
                    std::iter::repeat_n(m, g.len())
                })
                .collect();
            compare(
                &format!("dequantize {name}"),
                &got[0],
                &want64,
                Some(&scale),
                Tolerance {
                    abs: 0.0,
                    rel: 4.0 * f32::EPSILON as f64,
                },
            )
            .map_err(s)
        })();
        let how = if runs { " (runs of 32)" } else { "" };
        push(out, &format!("dequantize {name}"), format!("{n}{how}"), res);
    }
}

/// The bound for a product of `m` rows of x with W (`rows`, `cols`), relative to the sum
/// of its terms' magnitudes: on cooperative matrices each term carries f16's rounding of
/// x (after the norm) and of W's value (2 x 2^-11), then f32 sums; otherwise f32's
/// dot-product bound.
fn product_tol(gpu: &Gpu, m: usize, rows: usize, cols: usize) -> Tolerance {
    match uses_coop(gpu, m, rows, cols) {
        true => Tolerance {
            abs: 1e-30,
            rel: 1.5e-3,
        },
        false => Tolerance::dot(cols),
    }
}

/// (type, columns) of the test matrices: two whole blocks (three for 32-element types);
/// for the unblocked types a multiple of 4 (vector loads) and, for two of them, not.
pub fn product_cases() -> Vec<(&'static str, usize)> {
    let mut v: Vec<(&str, usize)> = SUPPORTED
        .iter()
        .map(|&t| match t {
            "F32" | "F16" | "BF16" => (t, 68),
            "Q4_K" | "Q5_K" | "Q6_K" => (t, 512),
            _ => (t, 96),
        })
        .collect();
    // Rows longer than two passes of the matrix-vector kernel's 32 threads x 32 columns
    // (lanes with 3 passes and with 2), in the smaller K-quant blocks; 16-bit floats whose
    // odd rows start half a vec4 in.
    v.extend([("F32", 70), ("F16", 70), ("BF16", 70), ("Q6_K", 2816)]);
    v
}

/// Row gathers and products of every type against the CPU dequantizer and f64 sums:
/// y = x @ W^T for 1 and 3 rows of x (matrix-vector kernel) and 67 rows in a batch of 2
/// (tiled), W with 37 rows; ids gathered in an arbitrary order.
pub(super) async fn product_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, (name, cols)) in product_cases().into_iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let rows = 37usize;
        let mut rng = Rng::new(2900 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = match cpu::dequantize(ty, &raw, rows * cols) {
            Ok(w) => w,
            Err(e) => {
                push(out, &format!("qmatmul {name}"), String::new(), Err(s(e)));
                continue;
            }
        };
        // Gather.
        let ids: Vec<u32> = vec![5, 0, 36, 5, 17];
        let r = twice("get_rows", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let ids_t = Tensor::from_u32(gpu, &[ids.len()], &ids, "ids")?;
            let y = gpu.run_async(|rec| get_rows(rec, &q, &ids_t)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let want: Vec<f64> = ids
            .iter()
            .flat_map(|&id| w[id as usize * cols..][..cols].iter().map(|&v| v as f64))
            .collect();
        let res = r.and_then(|got| {
            compare(
                &format!("get_rows {name}"),
                &got[0],
                &want,
                None,
                Tolerance { abs: 0.0, rel: 0.0 },
            )
            .map_err(s)
        });
        push(
            out,
            &format!("get_rows {name}"),
            format!("{} of ({rows}, {cols})", ids.len()),
            res,
        );
        // Products.
        for shape in [vec![1usize], vec![MATVEC_MAX_ROWS - 1], vec![2, 67]] {
            let m: usize = shape.iter().product();
            let xv = rng.vec(m * cols);
            let mut xs = shape.clone();
            xs.push(cols);
            let r = twice("qmatmul", async || {
                let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
                let xt = Tensor::from_f32(gpu, &xs, &xv, "x")?;
                let y = gpu.run_async(|rec| qmatmul(rec, &xt, &q)).await?;
                Ok(vec![y.to_vec_f32(gpu).await?])
            })
            .await;
            let mut want = vec![0.0f64; m * rows];
            let mut mag = vec![0.0f64; m * rows];
            for a in 0..m {
                for j in 0..rows {
                    for c in 0..cols {
                        let t = xv[a * cols + c] as f64 * w[j * cols + c] as f64;
                        want[a * rows + j] += t;
                        mag[a * rows + j] += t.abs();
                    }
                }
            }
            let res = r.and_then(|got| {
                compare(
                    &format!("qmatmul {name}"),
                    &got[0],
                    &want,
                    Some(&mag),
                    product_tol(gpu, m, rows, cols),
                )
                .map_err(s)
            });
            push(
                out,
                &format!("qmatmul {name}"),
                format!("x {xs:?} @ ({rows}, {cols})^T"),
                res,
            );
        }
        // W untransposed (the backward's dX = dY W): one row of dy, and 2 x 67.
        for shape in [vec![1usize], vec![2, 67]] {
            let m: usize = shape.iter().product();
            let dy = rng.vec(m * rows);
            let mut ds = shape.clone();
            ds.push(rows);
            let r = twice("qmatmul_t", async || {
                let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
                let dt = Tensor::from_f32(gpu, &ds, &dy, "dy")?;
                let y = gpu.run_async(|rec| qmatmul_t(rec, &dt, &q)).await?;
                Ok(vec![y.to_vec_f32(gpu).await?])
            })
            .await;
            let mut want = vec![0.0f64; m * cols];
            let mut mag = vec![0.0f64; m * cols];
            for a in 0..m {
                for j in 0..rows {
                    for c in 0..cols {
                        let t = dy[a * rows + j] as f64 * w[j * cols + c] as f64;
                        want[a * cols + c] += t;
                        mag[a * cols + c] += t.abs();
                    }
                }
            }
            let res = r.and_then(|got| {
                compare(
                    &format!("qmatmul_t {name}"),
                    &got[0],
                    &want,
                    Some(&mag),
                    Tolerance::dot(rows),
                )
                .map_err(s)
            });
            push(
                out,
                &format!("qmatmul_t {name}"),
                format!("dy {ds:?} @ ({rows}, {cols})"),
                res,
            );
        }
    }
}

/// The fused products against f64: RMSNorm before with SwiGLU of stacked gate/up rows, and
/// a residual added after; for one 32-element type, one K-quant, and f32 with an odd width
/// (scalar path); on 1, 31 and 2 x 67 rows of x (both kernels); and K-quant Ws tall
/// enough, or with rows long enough, for the one-row decode kernel (both layouts).
pub(super) async fn fused_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let all = vec![vec![1usize], vec![MATVEC_MAX_ROWS - 1], vec![2, 67]];
    // (type, cols, rows of W: half gate, half up, shapes of x). The last has enough rows
    // for the one-row decode kernel (qmatvec1).
    let cases = [
        ("Q4_1", 96usize, 38usize, all.clone()),
        ("Q4_K", 512, 38, all.clone()),
        ("F32", 70, 38, all),
        ("Q4_K", 512, MATVEC1_MIN_ROWS + 6, vec![vec![1]]),
        ("Q4_K", SPLITK_MIN_COLS, 38, vec![vec![1]]),
    ];
    for (i, (name, cols, rows, shapes)) in cases.into_iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(3900 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let eps = 1e-5f32;
        for shape in shapes {
            let m: usize = shape.iter().product();
            let xv = rng.vec(m * cols);
            let resv = rng.vec(m * rows);
            let mut xs = shape.clone();
            xs.push(cols);
            let mut ys = shape.clone();
            ys.push(rows);
            let r = twice("qmatmul fused", async || {
                let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
                let xt = Tensor::from_f32(gpu, &xs, &xv, "x")?;
                let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
                let rt = Tensor::from_f32(gpu, &ys, &resv, "res")?;
                let (a, b) = gpu
                    .run_async(|rec| {
                        let a = qmatmul_fused(
                            rec,
                            &xt,
                            &q,
                            Fuse {
                                norm: Some((&nwt, eps)),
                                swiglu: true,
                                ..Default::default()
                            },
                        )?;
                        let b = qmatmul_fused(
                            rec,
                            &xt,
                            &q,
                            Fuse {
                                residual: Some(&rt),
                                ..Default::default()
                            },
                        )?;
                        Ok((a, b))
                    })
                    .await?;
                Ok(vec![a.to_vec_f32(gpu).await?, b.to_vec_f32(gpu).await?])
            })
            .await;
            // f64: h = x / rms(x) * nw; gate/up dots; silu(g) * u. And res + x W^T.
            let half = rows / 2;
            let (mut sw, mut sw_mag, mut rs, mut rs_mag) = (
                vec![0.0; m * half],
                vec![0.0; m * half],
                vec![0.0; m * rows],
                vec![0.0; m * rows],
            );
            // The decode kernel rounds x (times the norm weight) to 8 bits for some types.
            let rounds = decode_rounds_x(gpu, m, ty, rows, cols);
            for a in 0..m {
                let xr = &xv[a * cols..(a + 1) * cols];
                let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
                let rstd = 1.0 / (ms + eps as f64).sqrt();
                let xn: Vec<f32> = xr.iter().zip(&nw).map(|(v, g)| v * g).collect();
                let (xn8, x8) = match rounds {
                    true => (cpu::round_x8(&xn), cpu::round_x8(xr)),
                    false => (vec![], vec![]),
                };
                let dot = |j: usize, norm: bool| -> (f64, f64) {
                    let mut s = 0.0;
                    let mut g = 0.0;
                    for c in 0..cols {
                        let h = match (norm, rounds) {
                            (true, false) => xr[c] as f64 * rstd * nw[c] as f64,
                            (true, true) => xn8[c] as f64 * rstd,
                            (false, false) => xr[c] as f64,
                            (false, true) => x8[c] as f64,
                        };
                        let t = h * w[j * cols + c] as f64;
                        s += t;
                        g += t.abs();
                    }
                    (s, g)
                };
                for j in 0..half {
                    let ((g, gm), (u, um)) = (dot(j, true), dot(half + j, true));
                    let sig = 1.0 / (1.0 + (-g).exp());
                    sw[a * half + j] = g * sig * u;
                    // Errors in g and u carry through silu(g) * u: |u| gm + |g| um bounds them.
                    sw_mag[a * half + j] =
                        u.abs() * gm + (g * sig).abs() * um + (g * sig * u).abs();
                }
                for j in 0..rows {
                    let (d, dm) = dot(j, false);
                    rs[a * rows + j] = resv[a * rows + j] as f64 + d;
                    rs_mag[a * rows + j] = resv[a * rows + j].abs() as f64 + dm;
                }
            }
            let res = r.and_then(|got| {
                compare(
                    &format!("qmatmul norm+swiglu {name}"),
                    &got[0],
                    &sw,
                    Some(&sw_mag),
                    product_tol(gpu, m, rows, cols),
                )
                .map_err(s)?;
                compare(
                    &format!("qmatmul residual {name}"),
                    &got[1],
                    &rs,
                    Some(&rs_mag),
                    product_tol(gpu, m, rows, cols),
                )
                .map_err(s)
            });
            push(
                out,
                &format!("qmatmul fused {name}"),
                format!("x {xs:?} @ ({rows}, {cols})^T"),
                res,
            );
        }
    }
}

/// Rows of x into f16 for the cooperative product (`x_half`), on any adapter: plain and
/// after RMSNorm, rows of 68 and 2,000 (one and two passes of 256 threads), in a batch,
/// with a row f16 cannot hold (x 1e6: scaled down by a power of two, the factor back)
/// and a row of zeros; against f64 rounded to f16 (within one f16 step: the GPU's f32
/// arithmetic before the rounding), the factors exactly.
pub(super) async fn half_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, (shape, k, norm)) in [
        (vec![3usize], 68usize, false),
        (vec![2, 5], 2000, true),
        (vec![2, 5], 2000, false),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(5900 + i as u64);
        let m: usize = shape.iter().product();
        let mut xv = rng.vec(m * k);
        xv[k..2 * k].iter_mut().for_each(|v| *v *= 1e6);
        xv[2 * k..3 * k].iter_mut().for_each(|v| *v = 0.0);
        let nw: Vec<f32> = rng.vec(k).iter().map(|v| 1.0 + 0.5 * v).collect();
        let eps = 1e-5f32;
        let mut xs = shape.clone();
        xs.push(k);
        let r = twice("x_half", async || {
            let xt = Tensor::from_f32(gpu, &xs, &xv, "x")?;
            let nwt = Tensor::from_f32(gpu, &[k], &nw, "nw")?;
            let (h, f) = gpu
                .run_async(|rec| x_half(rec, &xt, k, norm.then_some((&nwt, eps))))
                .await?;
            let words = h.to_vec_u32(gpu).await?;
            let halves = words
                .iter()
                .flat_map(|w| [*w as u16, (*w >> 16) as u16])
                .map(|b| f16::from_bits(b).to_f32())
                .collect();
            Ok(vec![halves, f.to_vec_f32(gpu).await?])
        })
        .await;
        let mut want_h = vec![0.0f64; m * k];
        let mut scale = vec![0.0f64; m * k];
        let mut want_f = vec![0.0f64; m];
        for a in 0..m {
            let xr = &xv[a * k..(a + 1) * k];
            let f = match norm {
                true => {
                    let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / k as f64;
                    1.0 / (ms + eps as f64).sqrt()
                }
                false => 1.0,
            };
            let y: Vec<f64> = (0..k)
                .map(|c| xr[c] as f64 * f * if norm { nw[c] as f64 } else { 1.0 })
                .collect();
            let top = y.iter().fold(0.0f64, |t, v| t.max(v.abs()));
            let mut s = 0i32;
            while top * 2f64.powi(-s) >= 32768.0 {
                s += 1;
            }
            want_f[a] = 2f64.powi(s);
            for c in 0..k {
                let v = y[c] * 2f64.powi(-s);
                want_h[a * k + c] = f16::from_f64(v).to_f64();
                // One f16 step at v (the GPU rounds its f32 value, not v).
                scale[a * k + c] = v.abs().max(6.1e-5);
            }
        }
        let res = r.and_then(|got| {
            compare(
                "x_half",
                &got[0],
                &want_h,
                Some(&scale),
                Tolerance {
                    abs: 0.0,
                    rel: 1.0 / 1024.0,
                },
            )
            .map_err(s)?;
            compare(
                "x_half factors",
                &got[1],
                &want_f,
                None,
                Tolerance { abs: 0.0, rel: 0.0 },
            )
            .map_err(s)
        });
        let how = if norm { ", RMSNorm" } else { "" };
        push(
            out,
            "x_half",
            format!("x {xs:?}{how}, row 1 x 1e6, row 2 zeros"),
            res,
        );
    }
}

/// What a cooperative-matrix case fuses into its product.
#[derive(Clone, Copy)]
enum CoopFuse {
    Plain,
    Residual,
    /// RMSNorm before, SwiGLU (or GeGLU) of stacked gate/up rows after.
    NormGlu {
        geglu: bool,
    },
}

/// The cooperative-matrix product (`quant_coop.wgsl`, where the adapter has one) on what
/// the shared cases above do not reach: enough tiles for whole tiles stored straight to
/// the output, slices of k (few tiles) with and without the residual, a row past f16's
/// range (scaled by a power of two and back), RMSNorm with GeGLU, 33 rows of x (the
/// fewest it takes); against f64 with f16's bound on each term.
pub(super) async fn coop_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    if !gpu.quant_coop {
        return;
    }
    // (type, cols, rows of W, shape of x, fusion, a row of x scaled by 1e6).
    let cases = [
        (
            "Q8_0",
            64usize,
            5632usize,
            vec![384usize],
            CoopFuse::Plain,
            false,
        ),
        ("Q6_K", 512, 300, vec![3, 50], CoopFuse::Plain, true),
        ("Q6_K", 512, 300, vec![3, 50], CoopFuse::Residual, true),
        (
            "Q4_K",
            1024,
            520,
            vec![2, 100],
            CoopFuse::NormGlu { geglu: false },
            true,
        ),
        (
            "BF16",
            132,
            200,
            vec![33],
            CoopFuse::NormGlu { geglu: true },
            false,
        ),
        ("Q5_0", 96, 130, vec![257], CoopFuse::Residual, false),
        // Few rows (qmatmul_coop_skinny): tiles of 16 rows (9 of them used), 32 (17 used),
        // 64 (40 used, and all 64).
        ("Q4_0", 96, 300, vec![9], CoopFuse::Plain, false),
        ("Q6_K", 512, 300, vec![17], CoopFuse::Residual, true),
        (
            "Q4_K",
            1024,
            520,
            vec![2, 20],
            CoopFuse::NormGlu { geglu: false },
            true,
        ),
        ("F16", 68, 130, vec![64], CoopFuse::Plain, false),
    ];
    for (i, (name, cols, rows, shape, fuse, big)) in cases.into_iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(4900 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        let m: usize = shape.iter().product();
        let mut xv = rng.vec(m * cols);
        if big {
            xv[7 * cols..8 * cols].iter_mut().for_each(|v| *v *= 1e6);
        }
        let nw: Vec<f32> = rng.vec(cols).iter().map(|v| 1.0 + 0.5 * v).collect();
        let outs = match fuse {
            CoopFuse::NormGlu { .. } => rows / 2,
            _ => rows,
        };
        let resv = rng.vec(m * outs);
        let eps = 1e-5f32;
        let mut xs = shape.clone();
        xs.push(cols);
        let mut ys = shape.clone();
        ys.push(outs);
        let r = twice("qmatmul coop", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let xt = Tensor::from_f32(gpu, &xs, &xv, "x")?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let rt = Tensor::from_f32(gpu, &ys, &resv, "res")?;
            // The tiled cooperative product even where a small model's prompt product
            // would take qmatvec_rows (which `qmatmul fused` and the invariant checks check).
            let tiled = Fuse {
                tiled: true,
                ..Default::default()
            };
            let f = match fuse {
                CoopFuse::Plain => tiled,
                CoopFuse::Residual => Fuse {
                    residual: Some(&rt),
                    ..tiled
                },
                CoopFuse::NormGlu { geglu } => Fuse {
                    norm: Some((&nwt, eps)),
                    swiglu: true,
                    geglu,
                    ..tiled
                },
            };
            let y = gpu.run_async(|rec| qmatmul_fused(rec, &xt, &q, f)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let mut want = vec![0.0f64; m * outs];
        let mut mag = vec![0.0f64; m * outs];
        for a in 0..m {
            let xr = &xv[a * cols..(a + 1) * cols];
            let h: Vec<f64> = match fuse {
                CoopFuse::NormGlu { .. } => {
                    let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
                    let rstd = 1.0 / (ms + eps as f64).sqrt();
                    xr.iter()
                        .zip(&nw)
                        .map(|(&v, &g)| v as f64 * rstd * g as f64)
                        .collect()
                }
                _ => xr.iter().map(|&v| v as f64).collect(),
            };
            let dot = |j: usize| -> (f64, f64) {
                let row = &w[j * cols..(j + 1) * cols];
                h.iter().zip(row).fold((0.0, 0.0), |(s, g), (&x, &v)| {
                    (s + x * v as f64, g + (x * v as f64).abs())
                })
            };
            for j in 0..outs {
                let at = a * outs + j;
                (want[at], mag[at]) = match fuse {
                    CoopFuse::Plain => dot(j),
                    CoopFuse::Residual => {
                        let (d, dm) = dot(j);
                        (resv[at] as f64 + d, resv[at].abs() as f64 + dm)
                    }
                    CoopFuse::NormGlu { geglu } => {
                        let ((g, gm), (u, um)) = (dot(j), dot(outs + j));
                        let act = match geglu {
                            true => {
                                let t = (0.7978845608028654 * (g + 0.044715 * g * g * g)).tanh();
                                0.5 * g * (1.0 + t)
                            }
                            false => g / (1.0 + (-g).exp()),
                        };
                        // Errors in g and u carry through act(g) u: |u| gm + |act| um.
                        (act * u, u.abs() * gm + act.abs() * um + (act * u).abs())
                    }
                };
            }
        }
        let what = match fuse {
            CoopFuse::Plain => "",
            CoopFuse::Residual => " + residual",
            CoopFuse::NormGlu { geglu: false } => " norm, swiglu",
            CoopFuse::NormGlu { geglu: true } => " norm, geglu",
        };
        let res = r.and_then(|got| {
            compare(
                &format!("qmatmul coop {name}"),
                &got[0],
                &want,
                Some(&mag),
                product_tol(gpu, m, rows, cols),
            )
            .map_err(s)
        });
        let scaled = if big { ", row 7 x 1e6" } else { "" };
        push(
            out,
            &format!("qmatmul coop {name}"),
            format!("x {xs:?} @ ({rows}, {cols})^T{what}{scaled}"),
            res,
        );
    }
    coop_t_checks(gpu, out).await;
}

/// dX = dY W (`qmatmul_t`) on cooperative matrices (`quant_coop.wgsl` with TRANS_W, more
/// than 64 rows of dY) against f64 sums over the CPU dequantizer: every block family (K-quants,
/// 32-element blocks decoded by runs and by 4 values, 16-bit floats and f32), W's rows (the
/// sum) not a multiple of a step, W's columns not a multiple of a run or of a tile, several
/// row tiles, split k (a long sum over few output tiles); in every case a row of dY scaled
/// by 1e-7 (f16 would hold it only as subnormals: x_half scales it up) and one by 1e5.
async fn coop_t_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::quant::uses_coop_t;
    // (type, rows of W (the sum), columns of W (the outputs), rows of dY).
    let cases = [
        ("Q4_K", 132usize, 512usize, 150usize),
        ("Q6_K", 68, 768, 200),
        ("Q5_K", 36, 256, 130),
        ("Q4_1", 100, 96, 129),
        ("Q5_1", 64, 160, 70),
        ("Q8_0", 64, 96, 300),
        ("Q4_0", 4096, 256, 100),
        ("F16", 40, 68, 257),
        ("BF16", 44, 132, 80),
        ("F32", 16, 64, 65),
    ];
    for (i, (name, rows, cols, m)) in cases.into_iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(5300 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        let mut dy = rng.vec(m * rows);
        dy[5 * rows..6 * rows].iter_mut().for_each(|v| *v *= 1e-7);
        dy[9 * rows..10 * rows].iter_mut().for_each(|v| *v *= 1e5);
        let r = twice("qmatmul_t coop", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let dt = Tensor::from_f32(gpu, &[m, rows], &dy, "dy")?;
            let y = gpu.run_async(|rec| qmatmul_t(rec, &dt, &q)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let (mut want, mut mag) = (vec![0.0f64; m * cols], vec![0.0f64; m * cols]);
        for a in 0..m {
            for j in 0..rows {
                let d = dy[a * rows + j] as f64;
                for c in 0..cols {
                    let t = d * w[j * cols + c] as f64;
                    want[a * cols + c] += t;
                    mag[a * cols + c] += t.abs();
                }
            }
        }
        let coop = uses_coop_t(gpu, m, rows, cols);
        let tol = match coop {
            true => Tolerance {
                abs: 1e-30,
                rel: 1.5e-3,
            },
            false => Tolerance::dot(rows),
        };
        let res = r.and_then(|got| {
            compare(
                &format!("qmatmul_t coop {name}"),
                &got[0],
                &want,
                Some(&mag),
                tol,
            )
            .map_err(s)
        });
        push(
            out,
            &format!("qmatmul_t coop {name}"),
            format!(
                "dy [{m}, {rows}] @ ({rows}, {cols}), rows x 1e-7 and x 1e5{}",
                if coop { "" } else { " (not cooperative here)" }
            ),
            res,
        );
    }
}

/// The one-row decode kernel (`qmatvec1`, W tall enough, rows long enough to round x) for
/// every type against f64 sums over the CPU dequantizer, with x rounded to 8 bits first
/// where the kernel does (`decode_rounds_x`: integer dot products); W's rows an odd count.
pub(super) async fn decode_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let mut cases: Vec<(&str, usize, usize)> = SUPPORTED
        .iter()
        .map(|&t| (t, MATVEC1_MIN_ROWS + 3, XQ8_MIN_COLS))
        .collect();
    // Few rows of W, long enough for the decode kernel and for x's rounding to take two
    // workgroups (more than 256 groups of 16).
    cases.push(("Q4_K", 37, SPLITK_MIN_COLS + 512));
    for (i, (name, rows, cols)) in cases.into_iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(4900 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        // Two columns of a group at its largest magnitude, opposite signs (+-127 exactly).
        let mut xv = rng.vec(cols);
        xv[17] = 2.0;
        xv[20] = -2.0;
        let r = twice("qmatmul decode", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let xt = Tensor::from_f32(gpu, &[1, cols], &xv, "x")?;
            let y = gpu.run_async(|rec| qmatmul(rec, &xt, &q)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let rounds = decode_rounds_x(gpu, 1, ty, rows, cols);
        let x = match rounds {
            true => cpu::round_x8(&xv),
            false => xv.clone(),
        };
        let mut want = vec![0.0f64; rows];
        let mut mag = vec![0.0f64; rows];
        for j in 0..rows {
            for c in 0..cols {
                let t = x[c] as f64 * w[j * cols + c] as f64;
                want[j] += t;
                mag[j] += t.abs();
            }
        }
        let res = r.and_then(|got| {
            compare(
                &format!("qmatmul decode {name}"),
                &got[0],
                &want,
                Some(&mag),
                Tolerance::dot(cols),
            )
            .map_err(s)
        });
        let how = if rounds { ", x rounded to 8 bits" } else { "" };
        push(
            out,
            &format!("qmatmul decode {name}"),
            format!("x [1, {cols}] @ ({rows}, {cols})^T{how}"),
            res,
        );
    }
}

/// What a batched decode case fuses into its product.
#[derive(Clone, Copy)]
enum BatchFuse {
    Plain,
    Residual,
    /// The norm alone (a head's product).
    Norm,
    NormSwiglu,
}

impl BatchFuse {
    /// The product's options: the residual `rt`, or the norm (`nwt`, `eps`) and SwiGLU.
    fn fuse<'a>(self, rt: &'a Tensor, nwt: &'a Tensor, eps: f32) -> Fuse<'a> {
        match self {
            BatchFuse::Plain => Fuse::default(),
            BatchFuse::Residual => Fuse {
                residual: Some(rt),
                ..Default::default()
            },
            BatchFuse::Norm => Fuse {
                norm: Some((nwt, eps)),
                ..Default::default()
            },
            BatchFuse::NormSwiglu => Fuse {
                norm: Some((nwt, eps)),
                swiglu: true,
                ..Default::default()
            },
        }
    }

    /// f64 results and magnitudes (sum |terms|) of the rows `xv` (m, cols) through the
    /// dequantized `w` with this fusion (the norm's weight `nw` and epsilon; the residual
    /// `resv`, (m, outs)); x (times the norm weight) rounded to 8 bits first where
    /// `rounds`, the norm's factor from the unrounded row.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        self,
        xv: &[f32],
        w: &[f32],
        nw: &[f32],
        resv: &[f32],
        cols: usize,
        eps: f32,
        rounds: bool,
    ) -> (Vec<f64>, Vec<f64>) {
        let m = xv.len() / cols;
        let outs = resv.len() / m;
        let (mut want, mut mag) = (vec![0.0f64; m * outs], vec![0.0f64; m * outs]);
        let norm = matches!(self, BatchFuse::Norm | BatchFuse::NormSwiglu);
        for a in 0..m {
            let xr = &xv[a * cols..(a + 1) * cols];
            let h: Vec<f32> = match norm {
                true => xr.iter().zip(nw).map(|(v, g)| v * g).collect(),
                false => xr.to_vec(),
            };
            let h = if rounds { cpu::round_x8(&h) } else { h };
            let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let rstd = if norm {
                1.0 / (ms + eps as f64).sqrt()
            } else {
                1.0
            };
            let dot = |j: usize| -> (f64, f64) {
                let (mut s, mut g) = (0.0, 0.0);
                for c in 0..cols {
                    let t = h[c] as f64 * rstd * w[j * cols + c] as f64;
                    s += t;
                    g += t.abs();
                }
                (s, g)
            };
            for j in 0..outs {
                let at = a * outs + j;
                (want[at], mag[at]) = match self {
                    BatchFuse::Plain | BatchFuse::Norm => dot(j),
                    BatchFuse::Residual => {
                        let (d, dm) = dot(j);
                        (resv[at] as f64 + d, resv[at].abs() as f64 + dm)
                    }
                    BatchFuse::NormSwiglu => {
                        // Gate rows, then up rows: j and outs + j.
                        let ((g, gm), (u, um)) = (dot(j), dot(outs + j));
                        let sig = 1.0 / (1.0 + (-g).exp());
                        let y = g * sig * u;
                        (y, u.abs() * gm + (g * sig).abs() * um + y.abs())
                    }
                };
            }
        }
        (want, mag)
    }
}

/// (type, rows of W, columns, rows of x, fusion) of [`batch_checks`]: every type the
/// batched decode kernel takes, 2 .. 32 rows of x (one workgroup's 2, 4 or 8 rows, part
/// of one, and several row groups with a partial last), W tall (sets of 1 and 2 groups) or
/// short and long (4 groups a set), each fusion.
const BATCH_CASES: [(&str, usize, usize, usize, BatchFuse); 8] = [
    (
        "Q4_0",
        MATVEC1_MIN_ROWS + 3,
        XQ8_MIN_COLS,
        2,
        BatchFuse::Plain,
    ),
    (
        "Q4_1",
        MATVEC1_MIN_ROWS + 3,
        XQ8_MIN_COLS,
        3,
        BatchFuse::Plain,
    ),
    (
        "Q8_0",
        MATVEC1_MIN_ROWS + 3,
        XQ8_MIN_COLS,
        4,
        BatchFuse::Residual,
    ),
    ("Q4_K", MATVEC1_MIN_ROWS + 6, 2048, 5, BatchFuse::NormSwiglu),
    ("Q5_K", 37, SPLITK_MIN_COLS + 512, 8, BatchFuse::Plain),
    (
        "Q6_K",
        MATVEC1_MIN_ROWS + 3,
        XQ8_MIN_COLS,
        13,
        BatchFuse::Residual,
    ),
    (
        "Q4_K",
        MATVEC1_MIN_ROWS + 3,
        XQ8_MIN_COLS,
        MATVEC_MAX_ROWS,
        BatchFuse::Plain,
    ),
    ("Q6_K", 38, SPLITK_MIN_COLS, 7, BatchFuse::NormSwiglu),
];

/// Products of 2 .. 32 rows of x through W shaped for the decode kernel (batched decode
/// steps: `qmatmul_coop_skinny` where the adapter has cooperative matrices, else
/// `qmatvec_x8rows`) against f64 sums over the CPU dequantizer, each row of x (times the
/// norm weight) rounded to 8 bits where `decode_rounds_x` says it is, the norm's factor
/// from the unrounded row; plain, with the residual, and with the norm and SwiGLU.
pub(super) async fn batch_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    for (i, &(name, rows, cols, m, fuse)) in BATCH_CASES.iter().enumerate() {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(5100 + i as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        let xv = rng.vec(m * cols);
        let nw: Vec<f32> = (0..cols).map(|_| 0.5 + rng.uniform()).collect();
        let outs = match fuse {
            BatchFuse::NormSwiglu => rows / 2,
            _ => rows,
        };
        let resv = rng.vec(m * outs);
        let eps = 1e-5f32;
        let r = twice("qmatmul batch", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let xt = Tensor::from_f32(gpu, &[m, cols], &xv, "x")?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let rt = Tensor::from_f32(gpu, &[m, outs], &resv, "res")?;
            let f = fuse.fuse(&rt, &nwt, eps);
            let y = gpu.run_async(|rec| qmatmul_fused(rec, &xt, &q, f)).await?;
            Ok(vec![y.to_vec_f32(gpu).await?])
        })
        .await;
        let rounds = decode_rounds_x(gpu, m, ty, rows, cols);
        let (want, mag) = fuse.reference(&xv, &w, &nw, &resv, cols, eps, rounds);
        let res = r.and_then(|got| {
            compare(
                &format!("qmatmul batch {name}"),
                &got[0],
                &want,
                Some(&mag),
                product_tol(gpu, m, rows, cols),
            )
            .map_err(s)
        });
        let how = match fuse {
            BatchFuse::Plain => "",
            BatchFuse::Residual => ", + residual",
            BatchFuse::Norm => ", norm",
            BatchFuse::NormSwiglu => ", norm + SwiGLU",
        };
        let kernel = match (rounds, uses_coop(gpu, m, rows, cols)) {
            (true, _) => ", x rounded to 8 bits",
            (false, true) => ", cooperative (f16)",
            (false, false) => "",
        };
        push(
            out,
            &format!("qmatmul batch {name}"),
            format!("x [{m}, {cols}] @ ({rows}, {cols})^T{how}{kernel}"),
            res,
        );
    }
}

/// Decode products that round their outputs for the next product (`qmatmul_chain`: the
/// shapes of a layer's o with the residual, gate/up with the norm and SwiGLU, down with
/// the residual, then a normed product as the next layer's q/k/v or the output head): each
/// rounded row the same bits as `quantize_x8` makes of the product's output, and each
/// output within a dot product's rounding of the same product rounding its own x (the
/// chained ones take 16 rows of W a workgroup: another split of the work, where the
/// compiler may fuse other multiply-adds). Every link chains that the adapter's threads a
/// workgroup allow (`chain_rounds`; all of them on native adapters), and a row rounded after
/// one norm's weight given to a product with another is an error.
pub(super) async fn chain_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    let (e, f, h) = (2048usize, 5120usize, 4096usize);
    let eps = 1e-5f32;
    let shapes = [
        ("Q4_K", e, h),
        ("Q4_K", 2 * f, e),
        ("Q5_K", e, f),
        ("Q6_K", MATVEC1_MIN_ROWS + 3, e),
    ];
    let mut rng = Rng::new(4100);
    let raws: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(name, rows, cols)| random_blocks(name, rows * cols, &mut rng))
        .collect();
    let xv = rng.vec(h);
    let resv = rng.vec(e);
    let mut weight = || -> Vec<f32> { rng.vec(e).iter().map(|v| 1.0 + 0.5 * v).collect() };
    let (nbv, ndv) = (weight(), weight());
    let op = "qmatmul_chain";
    let mismatch = std::cell::Cell::new(None);
    let rounded = std::cell::RefCell::new(Vec::new());
    let r = twice(op, async || {
        let w = shapes
            .iter()
            .zip(&raws)
            .map(|(&(name, rows, cols), raw)| {
                let ty = GgmlType::from_name(name).expect("known type");
                QMatrix::new(gpu, name, raw, ty, rows, cols)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let xt = Tensor::from_f32(gpu, &[1, h], &xv, "x")?;
        let rt = Tensor::from_f32(gpu, &[1, e], &resv, "res")?;
        let nb = Tensor::from_f32(gpu, &[e], &nbv, "nb")?;
        let nd = Tensor::from_f32(gpu, &[e], &ndv, "nd")?;
        let (ys, x8s) = gpu
            .run_async(|rec| {
                let next = |i: usize, norm| {
                    Some(Next {
                        w: &w[i],
                        norm,
                        eps,
                    })
                };
                // Link by link: the chained product, and the same on the same input rounding
                // its own x.
                let fa = Fuse {
                    residual: Some(&rt),
                    ..Default::default()
                };
                let (ya, a8) = qmatmul_chain(rec, &xt, &w[0], fa, next(1, Some(&nb)))?;
                let ya_own = qmatmul_fused(rec, &xt, &w[0], fa)?;
                let fb = Fuse {
                    norm: Some((&nb, eps)),
                    swiglu: true,
                    ..Default::default()
                };
                let fb8 = Fuse {
                    x8: a8.as_ref(),
                    ..fb
                };
                let (g, g8) = qmatmul_chain(rec, &ya, &w[1], fb8, next(2, None))?;
                let g_own = qmatmul_fused(rec, &ya, &w[1], fb)?;
                let fc = Fuse {
                    residual: Some(&ya),
                    ..Default::default()
                };
                let fc8 = Fuse {
                    x8: g8.as_ref(),
                    ..fc
                };
                let (yc, c8) = qmatmul_chain(rec, &g, &w[2], fc8, next(3, Some(&nd)))?;
                let yc_own = qmatmul_fused(rec, &g, &w[2], fc)?;
                let fd = Fuse {
                    norm: Some((&nd, eps)),
                    ..Default::default()
                };
                let fd8 = Fuse {
                    x8: c8.as_ref(),
                    ..fd
                };
                let yd = qmatmul_fused(rec, &yc, &w[3], fd8)?;
                let yd_own = qmatmul_fused(rec, &yc, &w[3], fd)?;
                // Each rounded row next to quantize_x8's of the same output. A link chains
                // where the adapter offers the threads its workgroup needs (browsers offer
                // 256: the down product's 512 do not fit, and the next product rounds x
                // itself).
                let links = [
                    (a8, &ya, &w[0], false, Some(&nb), &w[1]),
                    (g8, &g, &w[1], true, None, &w[2]),
                    (c8, &yc, &w[2], false, Some(&nd), &w[3]),
                ];
                let mut x8s = Vec::new();
                for (x8, y, wl, swiglu, norm, wn) in links {
                    let own = quantize_x8(rec, y, wn.cols, norm.map(|n| (n, eps)))?;
                    let expect = chain_rounds(gpu, wl, swiglu, Next { w: wn, norm, eps });
                    match (x8, expect) {
                        (Some(x8), true) => x8s.push((x8, own)),
                        (None, false) => {}
                        (got, _) => {
                            return Err(crate::Error::Invalid {
                                op: "qmatmul_chain",
                                detail: format!(
                                    "the product of W ({}, {}) {} rounded its output: {}, \
                                     expected on this adapter: {expect}",
                                    wl.rows,
                                    wl.cols,
                                    wl.ty.name(),
                                    got.is_some()
                                ),
                            });
                        }
                    }
                }
                // Rounded after nd's weight, given with nb's.
                let wrong = quantize_x8(rec, &yc, w[3].cols, Some((&nd, eps)))?;
                let fuse = Fuse {
                    norm: Some((&nb, eps)),
                    x8: Some(&wrong),
                    ..Default::default()
                };
                mismatch.set(Some(qmatmul_fused(rec, &yc, &w[3], fuse).is_err()));
                Ok(([ya, g, yc, yd, ya_own, g_own, yc_own, yd_own], x8s))
            })
            .await?;
        let mut same = Vec::new();
        for (x8, own) in x8s {
            // Without a norm the rows have no squares.
            let words = x8.cols / 4 + x8.cols / 8 + x8.norm.as_ref().map_or(0, |_| x8.cols / 16);
            let a = x8.q.to_vec_u32(gpu).await?;
            let b = own.q.to_vec_u32(gpu).await?;
            same.push(a[..words] == b[..words]);
        }
        *rounded.borrow_mut() = same;
        let mut got = Vec::new();
        for y in &ys {
            got.push(y.to_vec_f32(gpu).await?);
        }
        Ok(got)
    })
    .await;
    let res = r.and_then(|got| {
        if rounded.borrow().iter().any(|same| !same) {
            return Err(
                "a product's rounded output differs from quantize_x8's of the same row".into(),
            );
        }
        let (chained, own) = got.split_at(4);
        let mut worst = Stats::default();
        for ((a, b), cols) in chained.iter().zip(own).zip([h, e, f, e]) {
            let want: Vec<f64> = b.iter().map(|&v| v as f64).collect();
            let st = compare(op, a, &want, None, Tolerance::dot(cols)).map_err(s)?;
            worst.max_abs = worst.max_abs.max(st.max_abs);
            worst.max_rel = worst.max_rel.max(st.max_rel);
        }
        Ok(worst)
    });
    push(
        out,
        op,
        format!(
            "o ({e}, {h}) Q4_K, gate/up ({}, {e}) Q4_K, down ({e}, {f}) Q5_K, head ({}, {e}) Q6_K; \
             {} of 3 links chained",
            2 * f,
            MATVEC1_MIN_ROWS + 3,
            rounded.borrow().len()
        ),
        res,
    );
    let res = match mismatch.get() {
        Some(true) => Ok(Stats::default()),
        Some(false) => Err("a row rounded after one norm's weight was taken with another".into()),
        None => Err("the chained run did not get that far".into()),
    };
    push(
        out,
        "qmatmul_chain mismatch",
        "x rounded after another norm's weight".into(),
        res,
    );
}

/// Tables split by rows (`RowSplit`: what one storage binding cannot hold, here forced
/// with parts of 7 rows' bytes): row gathers (ids in every part, the first and last rows,
/// one past the table reading zeros) bit-exact against the whole table's, and the product
/// of 3 rows of x with the norm against the whole table's (the parts' sums in the same
/// order for a row, copied into place).
pub(super) async fn split_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::quant::qmatmul_t;
    use crate::ops::quant::{get_rows, qmatmul_fused, Fuse, RowSplit};
    for (n, &ty_name) in ["Q8_0", "Q6_K", "F32"].iter().enumerate() {
        let (rows, cols) = (45usize, 256usize);
        let ty = GgmlType::from_name(ty_name).expect("known type");
        let mut rng = Rng::new(3700 + n as u64);
        let raw = random_blocks(ty_name, rows * cols, &mut rng);
        let (x, nw) = (rng.vec(3 * cols), rng.vec(cols));
        let dy = rng.vec(3 * rows);
        let ids: Vec<u32> = vec![0, 44, 7, 13, 45, 21, 6, 14, 30];
        let r = twice("row_split", async || {
            let whole = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let row_bytes = raw.len() / rows;
            let split = RowSplit::with_part_bytes(gpu, "w", &raw, ty, rows, cols, 7 * row_bytes)?;
            if split.parts.len() != 7 {
                return Err(crate::Error::Invalid {
                    op: "row_split",
                    detail: format!("{} parts, expected 7", split.parts.len()),
                });
            }
            let it = Tensor::from_u32(gpu, &[ids.len()], &ids, "ids")?;
            let xt = Tensor::from_f32(gpu, &[3, cols], &x, "x")?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let fuse = Fuse {
                norm: Some((&nwt, 1e-5)),
                ..Default::default()
            };
            let dyt = Tensor::from_f32(gpu, &[3, rows], &dy, "dy")?;
            let (a, b, c, d, e, f) = gpu
                .run_async(|rec| {
                    Ok((
                        split.get_rows(rec, &it)?,
                        get_rows(rec, &whole, &it)?,
                        split.product(rec, &xt, fuse)?,
                        qmatmul_fused(rec, &xt, &whole, fuse)?,
                        split.product_t(rec, &dyt)?,
                        qmatmul_t(rec, &dyt, &whole)?,
                    ))
                })
                .await?;
            let mut v = Vec::new();
            for t in [&a, &b, &c, &d, &e, &f] {
                v.push(t.to_vec_f32(gpu).await?);
            }
            Ok(v)
        })
        .await;
        let res = r.and_then(|got| {
            let rows_want: Vec<f64> = got[1].iter().map(|&v| v as f64).collect();
            compare(
                "row_split get_rows",
                &got[0],
                &rows_want,
                None,
                Tolerance { abs: 0.0, rel: 0.0 },
            )
            .map_err(s)?;
            let want: Vec<f64> = got[3].iter().map(|&v| v as f64).collect();
            compare(
                "row_split product",
                &got[2],
                &want,
                None,
                Tolerance::dot(cols),
            )
            .map_err(s)?;
            // dy @ W by parts (the sum over rows regrouped by part) and whole, against f64.
            let w = cpu::dequantize(ty, &raw, rows * cols).map_err(s)?;
            let mut want = vec![0.0f64; 3 * cols];
            let mut mag = vec![0.0f64; 3 * cols];
            for a in 0..3 {
                for j in 0..rows {
                    for c in 0..cols {
                        let t = dy[a * rows + j] as f64 * w[j * cols + c] as f64;
                        want[a * cols + c] += t;
                        mag[a * cols + c] += t.abs();
                    }
                }
            }
            let tol = Tolerance::dot(rows);
            compare("qmatmul_t", &got[5], &want, Some(&mag), tol).map_err(s)?;
            compare("row_split product_t", &got[4], &want, Some(&mag), tol).map_err(s)
        });
        push(
            out,
            "row_split",
            format!("({rows}, {cols}) {ty_name} in 7 parts, 9 ids, 3 rows of x and of dy"),
            res,
        );
    }
}

/// Batch-invariant products ([`Fuse::invariant`], batched serving): 37 rows of x through W,
/// and rows 0, 5, 20 and 36 each alone and runs of 2, 3, 4, 8 and 16 of them (each size a
/// layout of its own) — every row the same bits every way — and the 37 rows against f64
/// sums over the CPU dequantizer (on cooperative matrices: x rounded to f16, 1.5e-3 of sum
/// |x w|); plain, with the residual, and with the norm and SwiGLU; there also off them
/// ([`Fuse::simt`]: `qmatvec_rows`, as elsewhere). Rows of W 68 long (not whole runs of
/// 32) take the matrix-vector kernel `qmatvec` off cooperative matrices; two are tall (a
/// head's 16,384 rows and more: Q8_0 with the norm, a K-quant plain); two long (1536 and
/// 1600 columns: `qmatvec_rows` with more sets of threads than the base); the Q4_0 case's
/// 70 rows end inside a `qmatvec_rows` workgroup's 32.
pub(super) async fn invariant_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::quant::{invariant_on_coop, qmatmul_fused, Fuse};
    let cases: [(&str, usize, usize, BatchFuse); 10] = [
        ("Q4_1", 96, 576, BatchFuse::Plain),
        ("Q4_0", 70, 320, BatchFuse::Residual),
        // Rows longer than two passes of the base sets: more sets (16 in 3 passes, and 13
        // in 4 with a short last pass, where the adapter takes them).
        ("Q4_1", 64, 1536, BatchFuse::Residual),
        ("Q8_0", 40, 1600, BatchFuse::NormSwiglu),
        ("Q4_K", 64, 512, BatchFuse::NormSwiglu),
        ("Q6_K", 40, 256, BatchFuse::Residual),
        ("F16", 24, 64, BatchFuse::Plain),
        ("F16", 24, 68, BatchFuse::NormSwiglu),
        ("Q8_0", 16384 + 77, 96, BatchFuse::Norm),
        ("Q4_K", 16384, 256, BatchFuse::Plain),
    ];
    let m = 37usize;
    let alone = [0usize, 5, 20, 36];
    // (first row, rows): runs of the 37 run on their own.
    let runs = [(10usize, 2usize), (3, 3), (12, 4), (16, 8), (21, 16)];
    // Where cooperative products run, each case again with `simt` (qmatvec_rows).
    let ways = cases
        .iter()
        .enumerate()
        .flat_map(|(ci, c)| [(ci, *c, false), (ci, *c, true)])
        .filter(|&(_, (_, _, cols, _), simt)| !simt || invariant_on_coop(gpu, cols));
    for (ci, (name, rows, cols, fuse), simt) in ways {
        let ty = GgmlType::from_name(name).expect("known type");
        let mut rng = Rng::new(6200 + ci as u64);
        let raw = random_blocks(name, rows * cols, &mut rng);
        let w = cpu::dequantize(ty, &raw, rows * cols).expect("dequantizes");
        let xv = rng.vec(m * cols);
        let nw: Vec<f32> = (0..cols).map(|_| 0.5 + rng.uniform()).collect();
        let outs = match fuse {
            BatchFuse::NormSwiglu => rows / 2,
            _ => rows,
        };
        let resv = rng.vec(m * outs);
        let eps = 1e-5f32;
        let r = twice("qmatmul invariant", async || {
            let q = QMatrix::new(gpu, "w", &raw, ty, rows, cols)?;
            let nwt = Tensor::from_f32(gpu, &[cols], &nw, "nw")?;
            let run = async |r0: usize, n: usize| -> crate::Result<Vec<f32>> {
                let xt = Tensor::from_f32(gpu, &[n, cols], &xv[r0 * cols..(r0 + n) * cols], "x")?;
                let rt =
                    Tensor::from_f32(gpu, &[n, outs], &resv[r0 * outs..(r0 + n) * outs], "res")?;
                let f = fuse.fuse(&rt, &nwt, eps);
                let f = Fuse {
                    invariant: true,
                    simt,
                    ..f
                };
                let y = gpu.run_async(|rec| qmatmul_fused(rec, &xt, &q, f)).await?;
                y.to_vec_f32(gpu).await
            };
            let mut got = vec![run(0, m).await?];
            for &a in &alone {
                got.push(run(a, 1).await?);
            }
            for &(a, n) in &runs {
                got.push(run(a, n).await?);
            }
            Ok(got)
        })
        .await;
        let (want, mag) = fuse.reference(&xv, &w, &nw, &resv, cols, eps, false);
        let coop = invariant_on_coop(gpu, cols) && !simt;
        let tol = match coop {
            true => Tolerance {
                abs: 1e-30,
                rel: 1.5e-3,
            },
            false => Tolerance::dot(cols),
        };
        let res = r.and_then(|got| {
            let spans = alone.iter().map(|&a| (a, 1)).chain(runs);
            for (k, (a, n)) in spans.enumerate() {
                let batched = &got[0][a * outs..(a + n) * outs];
                if let Some(j) =
                    (0..n * outs).find(|&j| batched[j].to_bits() != got[k + 1][j].to_bits())
                {
                    return Err(format!(
                        "row {}, output {}: {} in a batch of {m}, {} in rows {a}..{}",
                        a + j / outs,
                        j % outs,
                        batched[j],
                        got[k + 1][j],
                        a + n
                    ));
                }
            }
            compare("qmatmul invariant", &got[0], &want, Some(&mag), tol).map_err(s)
        });
        let how = match fuse {
            BatchFuse::Plain => "",
            BatchFuse::Residual => ", + residual",
            BatchFuse::Norm => ", norm",
            BatchFuse::NormSwiglu => ", norm + SwiGLU",
        };
        push(
            out,
            "qmatmul invariant",
            format!(
                "x [{m}, {cols}] @ ({rows}, {cols})^T {name}{how}, rows {alone:?} alone and runs of 2 to 16 the same bits{}",
                match (coop, cols % 32 == 0) {
                    (true, _) => ", cooperative (f16)",
                    (false, true) => ", qmatvec_rows",
                    (false, false) => ", qmatvec (rows not whole runs of 32)",
                }
            ),
            res,
        );
    }
}

/// The invariant products' chain (batched serving, [`qmatmul_chain`] with
/// [`Fuse::invariant`]): the fused kernels alone against the pairs they replace, the same
/// bits on any adapter (`x_half_sum`: a split sum with its residual and the next norm's f16
/// halves; `glu_half`: SwiGLU / GeGLU and the down product's halves); then on cooperative
/// matrices the chains against each product rounding its own x, at 1, 5 and 37 rows: o
/// then gate/up (halves from the split sum), gate/up then down (halves from the GLU), and
/// q/k/v's unsummed partials into `rope_store_split` against the product into
/// `rope_store`. On adapters without the cooperative products nothing is chained (the
/// checks then say so).
pub(super) async fn invariant_chain_checks(gpu: &Gpu, out: &mut Vec<CheckResult>) {
    use crate::ops::kvcache::{rope_store, rope_store_split, RopeStore};
    use crate::ops::quant::{
        glu_half, glu_rows, invariant_on_coop, qmatmul_fused, qmatmul_unsummed, splitk_sum, x_half,
        x_half_sum, Fuse,
    };
    use crate::ops::rope::{Pairing, RopeTable};
    // The kernel alone (any adapter): x_half_sum against splitk_sum then x_half, every
    // output the same bits; rows of 576, 1000 and 4096 (one to four values a thread).
    for (ci, (m, n, splits)) in [(1usize, 576usize, 3usize), (37, 1000, 7), (5, 4096, 2)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(6400 + ci as u64);
        // (Values of several exponents and full mantissas: sums in another order differ.)
        let partv: Vec<f32> = rng
            .vec(splits * m * n)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 7.3 * (1 << (i % 5)) as f32)
            .collect();
        let resv: Vec<f32> = rng.vec(m * n).iter().map(|v| v * 40.0).collect();
        let nw: Vec<f32> = (0..n).map(|_| 0.5 + rng.uniform()).collect();
        let eps = 1e-6f32;
        let r = twice("x_half_sum", async || {
            let part = Tensor::from_f32(gpu, &[splits, m, n], &partv, "part")?;
            let res = Tensor::from_f32(gpu, &[m, n], &resv, "res")?;
            let nwt = Tensor::from_f32(gpu, &[n], &nw, "nw")?;
            let ya = Tensor::empty(gpu, &[m, n], crate::gpu::DType::F32, "ya")?;
            let yb = Tensor::empty(gpu, &[m, n], crate::gpu::DType::F32, "yb")?;
            let ((ha, fa), (hb, fb)) = gpu
                .run_async(|rec| {
                    let a = x_half_sum(rec, &part, &res, &ya, (&nwt, eps), m, n, splits)?;
                    splitk_sum(rec, &part, Some(&res), &yb, m, n, splits)?;
                    let b = x_half(rec, &yb, n, Some((&nwt, eps)))?;
                    Ok((a, b))
                })
                .await?;
            let bits = |v: Vec<u32>| v.into_iter().map(f32::from_bits).collect::<Vec<f32>>();
            Ok(vec![
                ya.to_vec_f32(gpu).await?,
                yb.to_vec_f32(gpu).await?,
                bits(ha.to_vec_u32(gpu).await?),
                bits(hb.to_vec_u32(gpu).await?),
                fa.to_vec_f32(gpu).await?,
                fb.to_vec_f32(gpu).await?,
            ])
        })
        .await;
        let res = r.and_then(|got| {
            for (what, k) in [("y", 0), ("halves", 2), ("rows' factors", 4)] {
                same_bits_as(what, &got[k], &got[k + 1], ("fused", "apart"))?;
            }
            Ok(Stats::default())
        });
        push(
            out,
            "qmatmul invariant chain",
            format!("x_half_sum: {splits} partials of [{m}, {n}] + residual, norm, f16 halves: the same bits as splitk_sum then x_half"),
            res,
        );
    }
    // glu_half alone (any adapter): against glu_rows then x_half without a norm, every
    // output the same bits; silu and GeGLU's gelu, rows of 1536, 1000 and 4096, values
    // large enough in some rows that the halves are scaled down. Split (3 partials of
    // gate/up, as a split invariant gate/up product leaves them): glu_rows also against
    // splitk_sum then glu_rows.
    for (ci, (m, n, geglu, splits)) in [
        (1usize, 1536usize, false, 1usize),
        (37, 1000, true, 1),
        (5, 4096, false, 1),
        (37, 1000, false, 3),
        (1, 1536, true, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(6500 + ci as u64);
        let guv: Vec<f32> = rng
            .vec(splits * 2 * m * n)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if (i / (2 * n)) % 3 == 1 {
                    v * 900.0
                } else {
                    v * 4.0
                }
            })
            .collect();
        let r = twice("glu_half", async || {
            let gu = Tensor::from_f32(gpu, &[splits, m, 2 * n], &guv, "gate_up")?;
            let ya = Tensor::empty(gpu, &[m, n], crate::gpu::DType::F32, "ya")?;
            let yb = Tensor::empty(gpu, &[m, n], crate::gpu::DType::F32, "yb")?;
            let yc = Tensor::empty(gpu, &[m, n], crate::gpu::DType::F32, "yc")?;
            let summed = Tensor::empty(gpu, &[m, 2 * n], crate::gpu::DType::F32, "summed")?;
            let ((ha, fa), (hb, fb)) = gpu
                .run_async(|rec| {
                    let a = glu_half(rec, &gu, &ya, m, n, geglu, splits)?;
                    glu_rows(rec, &gu, &yb, m, n, geglu, splits)?;
                    let b = x_half(rec, &yb, n, None)?;
                    if splits > 1 {
                        splitk_sum(rec, &gu, None, &summed, m, 2 * n, splits)?;
                        glu_rows(rec, &summed, &yc, m, n, geglu, 1)?;
                    }
                    Ok((a, b))
                })
                .await?;
            let bits = |v: Vec<u32>| v.into_iter().map(f32::from_bits).collect::<Vec<f32>>();
            let mut got = vec![
                ya.to_vec_f32(gpu).await?,
                yb.to_vec_f32(gpu).await?,
                bits(ha.to_vec_u32(gpu).await?),
                bits(hb.to_vec_u32(gpu).await?),
                fa.to_vec_f32(gpu).await?,
                fb.to_vec_f32(gpu).await?,
            ];
            if splits > 1 {
                got.push(yc.to_vec_f32(gpu).await?);
            }
            Ok(got)
        })
        .await;
        let res = r.and_then(|got| {
            if got[4].iter().all(|&f| f == 1.0) && m > 1 {
                return Err("no row was scaled down: the case misses what it checks".into());
            }
            for (what, k) in [("y", 0), ("halves", 2), ("rows' factors", 4)] {
                same_bits_as(what, &got[k], &got[k + 1], ("fused", "apart"))?;
            }
            if splits > 1 {
                same_bits_as("y", &got[1], &got[6], ("from partials", "summed first"))?;
            }
            Ok(Stats::default())
        });
        let parts = match splits {
            1 => String::new(),
            s => format!(" from {s} partials (and against splitk_sum then glu_rows)"),
        };
        push(
            out,
            "qmatmul invariant chain",
            format!(
                "glu_half: [{m}, 2 x {n}] {}{parts}, f16 halves: the same bits as glu_rows then x_half",
                if geglu { "GeGLU" } else { "SwiGLU" }
            ),
            res,
        );
    }
    // SmolLM2's gate/up (576 -> 2 x 1536, norm + SwiGLU) then down (1536 -> 576, residual):
    // the down product's halves made with SwiGLU (glu_half) against it rounding its own x;
    // and q/k/v (576 -> 960, norm) left unsummed over its slices of k, then summed as
    // splitk_sum sums, against the product.
    let (e, f, qkv_rows) = (576usize, 3072usize, 960usize);
    let eps = 1e-5f32;
    for (ci, m) in [1usize, 5, 37].into_iter().enumerate() {
        let mut rng = Rng::new(6600 + ci as u64);
        let raw1 = random_blocks("Q4_1", f * e, &mut rng);
        let raw2 = random_blocks("Q4_1", e * (f / 2), &mut rng);
        let raw3 = random_blocks("Q4_1", qkv_rows * e, &mut rng);
        let xv = rng.vec(m * e);
        let resv = rng.vec(m * e);
        let nw: Vec<f32> = (0..e).map(|_| 0.5 + rng.uniform()).collect();
        let r = twice("qmatmul invariant chain", async || {
            let ty = GgmlType::from_name("Q4_1").expect("known type");
            let w1 = QMatrix::new(gpu, "gate_up", &raw1, ty, f, e)?;
            let w2 = QMatrix::new(gpu, "down", &raw2, ty, e, f / 2)?;
            let w3 = QMatrix::new(gpu, "qkv", &raw3, ty, qkv_rows, e)?;
            let xt = Tensor::from_f32(gpu, &[m, e], &xv, "x")?;
            let rt = Tensor::from_f32(gpu, &[m, e], &resv, "res")?;
            let nwt = Tensor::from_f32(gpu, &[e], &nw, "nw")?;
            let first = Fuse {
                norm: Some((&nwt, eps)),
                swiglu: true,
                invariant: true,
                ..Default::default()
            };
            let second = Fuse {
                residual: Some(&rt),
                invariant: true,
                ..Default::default()
            };
            let qkv = Fuse {
                norm: Some((&nwt, eps)),
                invariant: true,
                ..Default::default()
            };
            let down = Next {
                w: &w2,
                norm: None,
                eps,
            };
            // q/k/v's partials into rope_store_split, against the product into rope_store:
            // SmolLM2's heads (9 + 2 x 3 of 64), f16 caches, positions 0..m.
            let table = RopeTable::new(gpu, m, 64, 10000.0)?;
            let cache = |name| {
                let z = vec![half::f16::ZERO; m * 3 * 64];
                Tensor::from_f16(gpu, &[m, 3, 64], &z, name)
            };
            let (ka, va, kb, vb) = (cache("ka")?, cache("va")?, cache("kb")?, cache("vb")?);
            let into = |k, v| RopeStore {
                bias: None,
                table: &table,
                pairing: Pairing::Interleaved,
                hq: 9,
                k_cache: k,
                v_cache: v,
                pos: 0,
                window: None,
                paged: None,
            };
            let (a1, a2, a3, made, splits) = gpu
                .run_async(|rec| {
                    let (g, h) = qmatmul_chain(rec, &xt, &w1, first, Some(down))?;
                    let made = h.is_some();
                    let z = qmatmul_fused(
                        rec,
                        &g,
                        &w2,
                        Fuse {
                            x8: h.as_ref(),
                            ..second
                        },
                    )?;
                    let (part, splits) = qmatmul_unsummed(rec, &xt, &w3, qkv)?;
                    let q = rope_store_split(rec, &part, splits, &into(&ka, &va))?;
                    Ok((g, z, q, made, splits))
                })
                .await?;
            let (b1, b2, b3) = gpu
                .run_async(|rec| {
                    let g = qmatmul_fused(rec, &xt, &w1, first)?;
                    let z = qmatmul_fused(rec, &g, &w2, second)?;
                    let y = qmatmul_fused(rec, &xt, &w3, qkv)?;
                    let q = rope_store(rec, &y, &into(&kb, &vb))?;
                    Ok((g, z, q))
                })
                .await?;
            let mut got = vec![
                a1.to_vec_f32(gpu).await?,
                a2.to_vec_f32(gpu).await?,
                a3.to_vec_f32(gpu).await?,
                b1.to_vec_f32(gpu).await?,
                b2.to_vec_f32(gpu).await?,
                b3.to_vec_f32(gpu).await?,
                vec![made as u32 as f32, splits as f32],
            ];
            for c in [&ka, &va, &kb, &vb] {
                got.push(
                    c.to_vec_f16(gpu)
                        .await?
                        .iter()
                        .map(|h| f32::from_bits(h.to_bits() as u32))
                        .collect(),
                );
            }
            Ok(got)
        })
        .await;
        let coop = invariant_on_coop(gpu, e);
        let res = r.and_then(|got| {
            let (made, splits) = (got[6][0] == 1.0, got[6][1]);
            if made != coop || (splits > 1.0) != coop {
                return Err(format!(
                    "halves made: {made}, q/k/v in {splits} slices; cooperative products here: {coop}"
                ));
            }
            for (what, k) in [("SwiGLU", 0), ("the down product", 1), ("q", 2)] {
                same_bits_as(what, &got[k], &got[k + 3], ("chained", "on its own"))?;
            }
            for (what, k) in [("the k cache", 7), ("the v cache", 8)] {
                same_bits_as(what, &got[k], &got[k + 2], ("summed inside", "summed first"))?;
            }
            Ok(Stats::default())
        });
        push(
            out,
            "qmatmul invariant chain",
            format!(
                "x [{m}, {e}] norm + SwiGLU ({f}, {e}) then + residual ({e}, {}); q/k/v ({qkv_rows}, {e}) unsummed: {}",
                f / 2,
                if coop {
                    "halves made with SwiGLU, q/k/v summed in rope_store, the same bits"
                } else {
                    "no cooperative products here: nothing chained or split"
                }
            ),
            res,
        );
    }
    // SmolLM2's o (576 -> 576, residual) then gate/up (576 -> 2 x 1536 with the norm, SwiGLU).
    let (e, f) = (576usize, 3072usize);
    let (t1, t2) = ("Q4_1", "Q4_1");
    let eps = 1e-5f32;
    for (ci, m) in [1usize, 5, 37].into_iter().enumerate() {
        let mut rng = Rng::new(6300 + ci as u64);
        let raw1 = random_blocks(t1, e * e, &mut rng);
        let raw2 = random_blocks(t2, f * e, &mut rng);
        let xv = rng.vec(m * e);
        let resv = rng.vec(m * e);
        let nw: Vec<f32> = (0..e).map(|_| 0.5 + rng.uniform()).collect();
        let r = twice("qmatmul invariant chain", async || {
            let ty1 = GgmlType::from_name(t1).expect("known type");
            let ty2 = GgmlType::from_name(t2).expect("known type");
            let w1 = QMatrix::new(gpu, "w1", &raw1, ty1, e, e)?;
            let w2 = QMatrix::new(gpu, "w2", &raw2, ty2, f, e)?;
            let xt = Tensor::from_f32(gpu, &[m, e], &xv, "x")?;
            let rt = Tensor::from_f32(gpu, &[m, e], &resv, "res")?;
            let nwt = Tensor::from_f32(gpu, &[e], &nw, "nw")?;
            let first = Fuse {
                residual: Some(&rt),
                invariant: true,
                ..Default::default()
            };
            let second = Fuse {
                norm: Some((&nwt, eps)),
                swiglu: true,
                invariant: true,
                ..Default::default()
            };
            let next = Next {
                w: &w2,
                norm: Some(&nwt),
                eps,
            };
            let (a1, a2, made) = gpu
                .run_async(|rec| {
                    let (y, h) = qmatmul_chain(rec, &xt, &w1, first, Some(next))?;
                    let made = h.is_some();
                    let z = qmatmul_fused(
                        rec,
                        &y,
                        &w2,
                        Fuse {
                            x8: h.as_ref(),
                            ..second
                        },
                    )?;
                    Ok((y, z, made))
                })
                .await?;
            let (b1, b2) = gpu
                .run_async(|rec| {
                    let y = qmatmul_fused(rec, &xt, &w1, first)?;
                    let z = qmatmul_fused(rec, &y, &w2, second)?;
                    Ok((y, z))
                })
                .await?;
            Ok(vec![
                a1.to_vec_f32(gpu).await?,
                a2.to_vec_f32(gpu).await?,
                b1.to_vec_f32(gpu).await?,
                b2.to_vec_f32(gpu).await?,
                vec![made as u32 as f32],
            ])
        })
        .await;
        let coop = invariant_on_coop(gpu, e);
        let res = r.and_then(|got| {
            let (a1, a2, b1, b2) = (&got[0], &got[1], &got[2], &got[3]);
            let made = got[4][0] == 1.0;
            if made != coop {
                return Err(format!(
                    "halves made: {made}, cooperative products here: {coop}"
                ));
            }
            for (what, a, b) in [("y", a1, b1), ("the next product", a2, b2)] {
                same_bits_as(what, a, b, ("chained", "each on its own x"))?;
            }
            Ok(Stats::default())
        });
        push(
            out,
            "qmatmul invariant chain",
            format!(
                "x [{m}, {e}] @ ({e}, {e})^T {t1} + residual, then norm + SwiGLU ({f}, {e}) {t2}: {}",
                if coop {
                    "halves made with the split sum, the same bits"
                } else {
                    "no cooperative products here: nothing chained"
                }
            ),
            res,
        );
    }
}
