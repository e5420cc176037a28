//! Comparing GPU results with the reference: per-op tolerances, and failures that name
//! the first bad index.

/// Element i passes when |got - want| <= abs + rel * scale_i, where scale_i is |want_i|
/// or, for sums, the sum of the magnitudes of the terms (what rounding error grows with).
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub abs: f64,
    pub rel: f64,
}

impl Tolerance {
    /// One f32 rounding per element (add, mul, scale).
    pub const ELEMENTWISE: Tolerance = Tolerance {
        abs: 0.0,
        rel: 1.2e-7,
    };

    /// A sum of `terms` f32 values, relative to the sum of their magnitudes. Rounding
    /// error in a sum of n terms is bounded by about n * eps * sum|x| (Higham, 2002); we
    /// allow 2 * (log2 n + 2) * eps, the bound for a pairwise/tree order, which ours is
    /// up to the short sequential runs inside each thread (at most 16 terms).
    pub fn sum(terms: usize) -> Tolerance {
        let depth = (terms.max(1) as f64).log2().ceil() + 2.0 + 16.0;
        Tolerance {
            abs: 1e-30,
            rel: 2.0 * depth * f32::EPSILON as f64,
        }
    }

    /// A dot product accumulated sequentially over `k` terms (matmul, convolution): the
    /// rounding error behaves like a random walk, ~ sqrt(k) * eps * sum|terms| (Higham,
    /// ch. 3, probabilistic bound); 4 sqrt(k) + 36 eps leaves room for the final
    /// scaling and bias additions.
    pub fn dot(k: usize) -> Tolerance {
        Tolerance {
            abs: 1e-30,
            rel: (4.0 * (k.max(1) as f64).sqrt() + 36.0) * f32::EPSILON as f64,
        }
    }
}

/// What a comparison found.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Stats {
    pub max_abs: f64,
    /// Largest |got - want| / scale.
    pub max_rel: f64,
}

#[derive(Clone, Debug)]
pub struct Mismatch {
    pub op: String,
    pub index: usize,
    pub got: f64,
    pub want: f64,
    pub allowed: f64,
    pub stats: Stats,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: first bad index {}: got {:e}, want {:e} (|diff| {:e} > allowed {:e})",
            self.op,
            self.index,
            self.got,
            self.want,
            (self.got - self.want).abs(),
            self.allowed
        )
    }
}

impl std::error::Error for Mismatch {}

/// Compares `got` with `want` elementwise; `scale` defaults to |want|.
pub fn compare(
    op: &str,
    got: &[f32],
    want: &[f64],
    scale: Option<&[f64]>,
    tol: Tolerance,
) -> Result<Stats, Mismatch> {
    let mut stats = Stats::default();
    let mut first_bad = None;
    if got.len() != want.len() {
        return Err(Mismatch {
            op: format!("{op} (length {} vs {})", got.len(), want.len()),
            index: got.len().min(want.len()),
            got: f64::NAN,
            want: f64::NAN,
            allowed: 0.0,
            stats,
        });
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = g as f64;
        let s = scale.map_or(w.abs(), |s| s[i]);
        let diff = (g - w).abs();
        let allowed = tol.abs + tol.rel * s;
        if diff.is_finite() {
            stats.max_abs = stats.max_abs.max(diff);
            if s > 0.0 {
                stats.max_rel = stats.max_rel.max(diff / s);
            }
        }
        // NaN never passes, nor does a wrong infinity.
        let ok = diff <= allowed || (g == w);
        if !ok && first_bad.is_none() {
            first_bad = Some((i, g, w, allowed));
        }
    }
    match first_bad {
        None => Ok(stats),
        Some((index, got, want, allowed)) => Err(Mismatch {
            op: op.to_string(),
            index,
            got,
            want,
            allowed,
            stats,
        }),
    }
}

/// Bit-for-bit equality (determinism checks); names the first differing index.
pub fn same_bits(op: &str, a: &[f32], b: &[f32]) -> Result<(), Mismatch> {
    let bad = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    match (bad, a.len() == b.len()) {
        (None, true) => Ok(()),
        (i, _) => {
            let index = i.unwrap_or(a.len().min(b.len()));
            Err(Mismatch {
                op: format!("{op} (rerun)"),
                index,
                got: b.get(index).map_or(f64::NAN, |&v| v as f64),
                want: a.get(index).map_or(f64::NAN, |&v| v as f64),
                allowed: 0.0,
                stats: Stats::default(),
            })
        }
    }
}

/// A small seeded generator (SplitMix64) for test data: same seed, same numbers, on every
/// platform.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_names_first_bad_index() {
        let err = compare(
            "op",
            &[1.0, 2.5, 9.0],
            &[1.0, 2.0, 3.0],
            None,
            Tolerance { abs: 0.1, rel: 0.0 },
        )
        .unwrap_err();
        assert_eq!(err.index, 1);
        assert!(err.to_string().contains("first bad index 1"), "{err}");
        assert!(compare(
            "op",
            &[f32::NAN],
            &[0.0],
            None,
            Tolerance { abs: 1.0, rel: 1.0 }
        )
        .is_err());
        let ok = compare(
            "op",
            &[1.0, 2.05],
            &[1.0, 2.0],
            None,
            Tolerance { abs: 0.1, rel: 0.0 },
        )
        .unwrap();
        assert!((ok.max_abs - 0.05).abs() < 1e-6);
    }

    #[test]
    fn same_bits_detects_sign_of_zero() {
        assert!(same_bits("op", &[0.0], &[-0.0]).is_err());
        assert!(same_bits("op", &[1.0, 2.0], &[1.0, 2.0]).is_ok());
    }

    #[test]
    fn rng_is_seeded_and_in_range() {
        let (a, b) = (Rng::new(7).vec(1000), Rng::new(7).vec(1000));
        assert_eq!(a, b);
        assert!(a.iter().all(|&x| (-1.0..1.0).contains(&x)));
        assert_ne!(a, Rng::new(8).vec(1000));
    }
}
