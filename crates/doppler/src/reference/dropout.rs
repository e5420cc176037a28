//! Dropout's mask, computed exactly as the shader does (integer hash), for bit-exact checks.

use crate::ops::dropout::Params;

fn pcg(v: u32) -> u32 {
    let state = v.wrapping_mul(747796405).wrapping_add(2891336453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277803737);
    (word >> 22) ^ word
}

pub fn keep(p: &Params, i: u32) -> bool {
    (pcg(pcg(i ^ pcg(p.seed_lo)) ^ p.seed_hi) >> 8) >= p.threshold
}

/// Attention dropout's draw for score (row, key j), row = (b Hq + h) Tq + i (wrapping in
/// u32), as attention.wgsl's `drop_row` and `drop_z` compute it.
pub fn attn_keep(p: &Params, row: u32, j: u32) -> bool {
    let rh = pcg(row ^ pcg(p.seed_lo));
    (pcg(rh ^ pcg(j ^ p.seed_hi)) >> 8) >= p.threshold
}

/// The f32 result the kernel must produce, bit for bit.
pub fn dropout(x: &[f32], p: &Params) -> Vec<f32> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| if keep(p, i as u32) { v * p.scale } else { 0.0 })
        .collect()
}
