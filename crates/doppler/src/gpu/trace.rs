//! Per-dispatch GPU timings, written as Chrome trace-event JSON (opens in Perfetto or
//! chrome://tracing).

#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceEvent {
    /// Pipeline name: "shader.entry[constants]".
    pub name: String,
    /// Workgroups dispatched (x, y, z); zeros for a whole-submission event.
    pub grid: [u32; 3],
    /// Nanoseconds since the first timestamp of the trace.
    pub start_ns: f64,
    pub dur_ns: f64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Trace {
    pub events: Vec<TraceEvent>,
    /// The GPU clock at the trace's first timestamp, in ns (comparable between the traces of
    /// one device: the gap from one submission's end to the next one's start).
    pub origin_ns: f64,
}

/// Totals per kernel name.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelTime {
    pub name: String,
    pub count: usize,
    pub total_ns: f64,
    pub median_ns: f64,
}

impl Trace {
    pub fn extend(&mut self, other: Trace) {
        let offset = self
            .events
            .last()
            .map(|e| e.start_ns + e.dur_ns)
            .unwrap_or(0.0);
        self.events.extend(other.events.into_iter().map(|mut e| {
            e.start_ns += offset;
            e
        }));
    }

    /// `{"traceEvents": [...]}` with complete ("X") events in microseconds.
    pub fn to_chrome_json(&self) -> String {
        let events: Vec<serde_json::Value> = self
            .events
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name, "cat": "gpu", "ph": "X", "pid": 0, "tid": 0,
                    "ts": e.start_ns / 1e3, "dur": e.dur_ns / 1e3, "args": { "grid": e.grid },
                })
            })
            .collect();
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ns" }).to_string()
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn write_chrome_json(&self, path: &std::path::Path) -> crate::Result<()> {
        use crate::Error;
        std::fs::write(path, self.to_chrome_json()).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })
    }

    /// Per-kernel count, total and median, slowest total first.
    pub fn by_kernel(&self) -> Vec<KernelTime> {
        Self::totals(self.events.iter().map(|e| (e.name.clone(), e.dur_ns)))
    }

    /// As [`Trace::by_kernel`], one row per kernel and grid ("name (x, y, z)"): which
    /// shapes of a kernel take the time.
    pub fn by_kernel_and_grid(&self) -> Vec<KernelTime> {
        Self::totals(self.events.iter().map(|e| {
            let [x, y, z] = e.grid;
            (format!("{} ({x}, {y}, {z})", e.name), e.dur_ns)
        }))
    }

    fn totals(events: impl Iterator<Item = (String, f64)>) -> Vec<KernelTime> {
        let mut map: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        for (name, dur) in events {
            map.entry(name).or_default().push(dur);
        }
        let mut out: Vec<KernelTime> = map
            .into_iter()
            .map(|(name, mut d)| KernelTime {
                name,
                count: d.len(),
                total_ns: d.iter().sum(),
                median_ns: median(&mut d),
            })
            .collect();
        out.sort_by(|a, b| b.total_ns.total_cmp(&a.total_ns));
        out
    }
}

/// Median of `v` (sorts it). NaN for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_by_kernel_and_by_grid() {
        let ev = |name: &str, grid: [u32; 3], dur_ns: f64| TraceEvent {
            name: name.into(),
            grid,
            start_ns: 0.0,
            dur_ns,
        };
        let t = Trace {
            events: vec![
                ev("mm", [6, 64, 1], 3.0),
                ev("mm", [24, 64, 1], 5.0),
                ev("mm", [6, 64, 1], 1.0),
                ev("add", [10, 1, 1], 2.0),
            ],
            origin_ns: 0.0,
        };
        let k = t.by_kernel();
        assert_eq!(
            (k[0].name.as_str(), k[0].count, k[0].total_ns),
            ("mm", 3, 9.0)
        );
        assert_eq!((k[1].name.as_str(), k[1].total_ns), ("add", 2.0));
        let g = t.by_kernel_and_grid();
        let names: Vec<&str> = g.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["mm (24, 64, 1)", "mm (6, 64, 1)", "add (10, 1, 1)"]);
        assert_eq!((g[1].count, g[1].total_ns, g[1].median_ns), (2, 4.0, 2.0));
    }
}
