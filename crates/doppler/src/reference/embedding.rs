//! Embedding gather and scatter-add in f64.

/// out (N, H) = table[ids]
pub fn embedding(table: &[f64], h: usize, ids: &[u32]) -> Vec<f64> {
    ids.iter()
        .flat_map(|&id| {
            table[id as usize * h..(id as usize + 1) * h]
                .iter()
                .copied()
        })
        .collect()
}

/// dtable (V, H): dout rows added into the row of their id.
pub fn embedding_backward(ids: &[u32], dout: &[f64], v: usize, h: usize) -> Vec<f64> {
    let mut d = vec![0.0; v * h];
    for (n, &id) in ids.iter().enumerate() {
        for k in 0..h {
            d[id as usize * h + k] += dout[n * h + k];
        }
    }
    d
}

/// The GPU kernel's exact summation, in f32: each id's rows in increasing position; ids seen
/// more than `segment` times as a sum, in order, of segments of `segment` rows (each summed
/// in order). The GPU result must match this bit for bit.
pub fn embedding_backward_f32_ordered(
    ids: &[u32],
    dout: &[f32],
    init: Option<&[f32]>,
    v: usize,
    h: usize,
    segment: usize,
) -> Vec<f32> {
    let mut buckets = vec![Vec::new(); v];
    for (n, &id) in ids.iter().enumerate() {
        buckets[id as usize].push(n);
    }
    let mut out = vec![0f32; v * h];
    for (id, pos) in buckets.iter().enumerate() {
        for k in 0..h {
            let mut a = init.map_or(0.0, |i| i[id * h + k]);
            if pos.len() <= segment {
                for &n in pos {
                    a += dout[n * h + k];
                }
            } else {
                for seg in pos.chunks(segment) {
                    a += seg.iter().fold(0f32, |s, &n| s + dout[n * h + k]);
                }
            }
            out[id * h + k] = a;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{assert_close, finite_diff};

    #[test]
    fn backward_matches_finite_differences() {
        let (v, h) = (5, 3);
        let ids = [4, 1, 4, 0, 4];
        let table: Vec<f64> = (0..v * h).map(|i| i as f64 * 0.1 - 0.5).collect();
        let g: Vec<f64> = (0..ids.len() * h).map(|i| (i % 7) as f64 - 3.0).collect();
        let f = |t: &[f64]| {
            embedding(t, h, &ids)
                .iter()
                .zip(&g)
                .map(|(a, b)| a * b)
                .sum()
        };
        assert_close(
            "embedding backward vs finite differences",
            &embedding_backward(&ids, &g, v, h),
            &finite_diff(f, &table),
            1e-8,
        );
    }
}
