//! The loss curve as a standalone SVG: training loss per step and validation loss at each
//! evaluation, on linear axes with tick labels.

/// (step, training loss) and (step, validation loss) points -> SVG text.
pub fn svg(train: &[(u64, f32)], val: &[(u64, f32)], title: &str) -> String {
    let (w, h, left, right, top, bottom) = (800.0, 480.0, 70.0, 20.0, 40.0, 50.0);
    let all = train.iter().chain(val).filter(|p| p.1.is_finite());
    let max_step = all.clone().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let (mut lo, mut hi) = all.fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1 as f64), hi.max(p.1 as f64))
    });
    if lo > hi {
        (lo, hi) = (0.0, 1.0);
    }
    if hi - lo < 1e-6 {
        hi = lo + 1.0;
    }
    let x = |s: u64| left + (s as f64 / max_step) * (w - left - right);
    let y = |l: f32| top + (hi - l as f64) / (hi - lo) * (h - top - bottom);
    let line = |pts: &[(u64, f32)]| -> String {
        pts.iter()
            .filter(|p| p.1.is_finite())
            .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        w / 2.0,
        escape(title)
    );
    for i in 0..=5 {
        let v = lo + (hi - lo) * i as f64 / 5.0;
        let yy = y(v as f32);
        s += &format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\n",
            w - right
        );
        s += &format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{v:.3}</text>\n",
            left - 6.0,
            yy + 4.0
        );
        let st = (max_step * i as f64 / 5.0).round() as u64;
        s += &format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{st}</text>\n",
            x(st),
            h - bottom + 18.0
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n",
        w / 2.0,
        h - 10.0
    );
    s += &format!("<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">loss</text>\n", h / 2.0, h / 2.0);
    s += &format!(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        line(train)
    );
    s += &format!(
        "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"2\" points=\"{}\"/>\n",
        line(val)
    );
    for p in val.iter().filter(|p| p.1.is_finite()) {
        s += &format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#d62728\"/>\n",
            x(p.0),
            y(p.1)
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" fill=\"#1f77b4\">train</text><text x=\"{}\" y=\"{}\" fill=\"#d62728\">validation</text>\n</svg>\n",
        w - 170.0,
        top + 16.0,
        w - 110.0,
        top + 16.0
    );
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn draws_both_series() {
        let s = super::svg(&[(1, 4.0), (2, 3.0), (3, f32::NAN)], &[(2, 3.5)], "run <a>");
        assert!(
            s.starts_with("<svg")
                && s.contains("polyline")
                && s.contains("<circle")
                && s.contains("run &lt;a&gt;")
        );
    }
}
