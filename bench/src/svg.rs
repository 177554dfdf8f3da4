//! TTFT CDFs as an SVG a person can look at: one chart per workload, one line per strategy,
//! time on a log axis.

use std::fmt::Write;

const COLORS: [&str; 6] = [
    "#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#d62728",
];

/// `series`: (strategy, sorted TTFTs in ms).
pub(crate) fn cdf_chart(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 420.0, 60.0, 170.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let all = series.iter().flat_map(|(_, v)| v.iter().copied());
    let lo = all.clone().fold(f64::INFINITY, f64::min).max(1.0);
    let hi = all.fold(1.0f64, f64::max).max(lo * 10.0);
    let (l0, l1) = (lo.log10().floor(), hi.log10().ceil());
    let x = |ms: f64| left + (ms.max(lo).log10() - l0) / (l1 - l0) * pw;
    let y = |p: f64| top + (1.0 - p) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{title}: time to first token, CDF</text>"#,
        left + pw / 2.0
    );
    for d in (l0 as i32)..=(l1 as i32) {
        let ms = 10f64.powi(d);
        let xx = x(ms);
        let label = if ms >= 1000.0 {
            format!("{} s", ms / 1000.0)
        } else {
            format!("{ms} ms")
        };
        let _ = write!(
            s,
            r##"<line x1="{xx}" y1="{top}" x2="{xx}" y2="{}" stroke="#ddd"/><text x="{xx}" y="{}" text-anchor="middle">{label}</text>"##,
            top + ph,
            top + ph + 18.0
        );
    }
    for p in [0.0, 0.25, 0.5, 0.75, 0.9, 1.0] {
        let yy = y(p);
        let _ = write!(
            s,
            r##"<line x1="{left}" y1="{yy}" x2="{}" y2="{yy}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{p}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0
        );
    }
    let _ = write!(
        s,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    for (i, (name, v)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let n = v.len().max(1) as f64;
        let step = (v.len() / 400).max(1);
        let mut pts = String::new();
        for (k, ms) in v.iter().enumerate().step_by(step) {
            let _ = write!(pts, "{:.1},{:.1} ", x(*ms), y((k + 1) as f64 / n));
        }
        if let Some(last) = v.last() {
            let _ = write!(pts, "{:.1},{:.1}", x(*last), y(1.0));
        }
        let _ = write!(
            s,
            r#"<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
        let ly = top + 16.0 + i as f64 * 18.0;
        let _ = write!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{name}</text>"#,
            w - right + 12.0,
            w - right + 32.0,
            w - right + 38.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}
