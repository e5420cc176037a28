//! CPU dequantizers for GGUF's tensor types, written from the block definitions in
//! ggml (`ggml-common.h` layouts, `dequantize_row_*`): the oracle for the GPU kernels.
//! Each block is decoded to f32 exactly as ggml does (f16 scales widened, then products in
//! f32), so the GPU kernels can be held to the same bits.

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::formats::gguf::GgmlType;

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block j (0..8) from the 12 packed bytes of a K-quant.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty.0 {
        // Q4_0: d (f16), 16 bytes: element j in the low nibble of byte j, j + 16 in the high.
        2 => {
            let d = h(b, 0);
            for j in 0..16 {
                y[j] = ((b[2 + j] & 0xF) as i32 - 8) as f32 * d;
                y[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        // Q4_1: d, m (f16), 16 bytes of nibbles: x = q d + m.
        3 => {
            let (d, m) = (h(b, 0), h(b, 2));
            for j in 0..16 {
                y[j] = (b[4 + j] & 0xF) as f32 * d + m;
                y[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
            }
        }
        // Q5_0: d, 32 high bits (u32), 16 bytes of low nibbles: x = (q - 16) d.
        6 => {
            let d = h(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = (((b[6 + j] & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                y[j + 16] = (((b[6 + j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
            }
        }
        // Q5_1: d, m, 32 high bits, 16 bytes: x = q d + m.
        7 => {
            let (d, m) = (h(b, 0), h(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = ((b[8 + j] & 0xF) as u32 | h0) as f32 * d + m;
                y[j + 16] = ((b[8 + j] >> 4) as u32 | h1) as f32 * d + m;
            }
        }
        // Q8_0: d, 32 signed bytes.
        8 => {
            let d = h(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        // Q4_K: d, dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes of
        // nibbles: each 32 bytes hold two sub-blocks (low nibbles, then high).
        12 => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let (sc, qs) = (&b[4..16], &b[16..144]);
            for c in 0..4 {
                let (s1, m1) = scale_min_k4(2 * c, sc);
                let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    y[64 * c + l] = d1 * (q & 0xF) as f32 - m1;
                    y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
                }
            }
        }
        // Q5_K: as Q4_K plus 32 bytes of fifth bits: sub-block pair c takes bits 2c, 2c+1.
        13 => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let (sc, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
            for c in 0..4 {
                let (s1, m1) = scale_min_k4(2 * c, sc);
                let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[64 * c + l] = d1 * ((q & 0xF) + hi1) as f32 - m1;
                    y[64 * c + 32 + l] = d2 * ((q >> 4) + hi2) as f32 - m2;
                }
            }
        }
        // Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed 8-bit scales,
        // d; two halves of 128 elements, each four runs of 32.
        14 => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |k: usize| d * (sc[is + k] as i8) as f32;
                    y[128 * n + l] = s(0) * q1 as f32;
                    y[128 * n + l + 32] = s(2) * q2 as f32;
                    y[128 * n + l + 64] = s(4) * q3 as f32;
                    y[128 * n + l + 96] = s(6) * q4 as f32;
                }
            }
        }
        _ => unreachable!("checked by dequantize"),
    }
}

/// Elements of a tensor of type `ty` stored in `data` (n elements), as f32.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    let bad = |detail: String| {
        Err(Error::Invalid {
            op: "dequantize",
            detail,
        })
    };
    let Some((per, bytes)) = ty.block() else {
        return bad(format!("unknown tensor type {}", ty.0));
    };
    let (per, bytes) = (per as usize, bytes as usize);
    if n % per != 0 || data.len() != n / per * bytes {
        return bad(format!(
            "{} elements of {} need {} bytes, got {}",
            n,
            ty.name(),
            n / per * bytes,
            data.len()
        ));
    }
    Ok(match ty.name() {
        "F32" => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "F16" => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        "BF16" => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" | "Q8_0" | "Q4_K" | "Q5_K" | "Q6_K" => {
            let mut y = vec![0.0f32; n];
            for (b, out) in data.chunks_exact(bytes).zip(y.chunks_exact_mut(per)) {
                block(ty, b, out);
            }
            y
        }
        other => return bad(format!("no dequantizer for {other}")),
    })
}

/// x rounded as the decode products round it (`quant.wgsl`'s XQ8): groups of 16
/// consecutive values, each to the nearest (ties to even) of q * max|x| / 127, q an integer
/// in -127..=127. `x.len()` is a multiple of 16.
pub fn round_x8(x: &[f32]) -> Vec<f32> {
    x.chunks(16)
        .flat_map(|g| {
            let amax = g.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let d = amax / 127.0;
            g.iter()
                .map(move |v| (v * inv).round_ties_even() * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_x8_keeps_16_column_groups_on_their_own_scales() {
        // Group 1: max 2 -> steps of 2/127; group 2 all zeros; group 3 an exact half step.
        let mut x = vec![0.0f32; 48];
        x[0] = -2.0;
        x[1] = 1.0;
        x[2] = 2.0 / 127.0 * 0.5; // exactly half a step: ties to even (0)
        x[3] = 2.0 / 127.0 * 1.5; // 1.5 steps: ties to even (2)
        x[32] = 127.0;
        x[33] = 2.5; // 2.5 steps: 2
        x[34] = -3.5; // -3.5 steps: -4
        let r = round_x8(&x);
        let d = 2.0f32 / 127.0;
        assert_eq!(r[0], -127.0 * d);
        assert_eq!(r[1], (1.0f32 * (127.0 / 2.0)).round_ties_even() * d);
        assert_eq!(r[2], 0.0);
        assert_eq!(r[3], 2.0 * d);
        assert!(r[16..32].iter().all(|&v| v == 0.0));
        assert_eq!((r[32], r[33], r[34]), (127.0, 2.0, -4.0));
        // Every value within half a step of x.
        for (g, (a, b)) in x.chunks(16).zip(r.chunks(16)).enumerate() {
            let step = a.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (u, v) in a.iter().zip(b) {
                assert!((u - v).abs() <= step * 0.5 + 1e-6, "group {g}: {u} -> {v}");
            }
        }
    }

    /// Against llama.cpp's gguf-py on random blocks (`scripts/make_quant_fixture.py`).
    #[test]
    fn matches_gguf_py_on_random_blocks() {
        let v: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/quant.json")).unwrap();
        let types = v["types"].as_object().unwrap();
        assert_eq!(types.len(), 10);
        for (name, case) in types {
            let hex = case["bytes"].as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let n = case["n"].as_u64().unwrap() as usize;
            let want: Vec<f32> = case["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let got = dequantize(GgmlType::from_name(name).unwrap(), &bytes, n).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits(),
                    "{name}[{i}]: ours {g}, gguf-py {w}"
                );
            }
        }
    }

    #[test]
    fn wrong_sizes_and_types_are_errors() {
        let e = dequantize(GgmlType(8), &[0; 33], 32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Q8_0") && e.contains("34"), "{e}");
        assert!(dequantize(GgmlType(99), &[], 0)
            .unwrap_err()
            .to_string()
            .contains("unknown tensor type 99"));
        assert!(dequantize(GgmlType(10), &[0; 84], 256)
            .unwrap_err()
            .to_string()
            .contains("Q2_K"));
    }
}
