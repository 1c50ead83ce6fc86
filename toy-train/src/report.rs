//! What `toy runs` shows: one-line summaries of runs and loss-curve plots, read from their
//! `events.jsonl` (`toy/v1`).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::TrainError;
use crate::events::{Event, read_events};

/// A run at a glance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// The run's id (its directory's name).
    pub id: String,
    /// The recipe's name; `vit` or `vit-fine-tune` for an image classifier.
    pub recipe: String,
    /// The preset the run started from, if any.
    pub preset: Option<String>,
    /// Trainable parameters.
    pub n_params: usize,
    /// Unix time the run (first) started.
    pub started: f64,
    /// Steps done: the last `step` event's.
    pub steps_done: usize,
    /// Steps the run is configured for.
    pub steps_total: usize,
    /// Training loss of the last step.
    pub loss: Option<f64>,
    /// Held-out loss of the last evaluation.
    pub eval_loss: Option<f64>,
    /// `run_end` was written: all steps ran.
    pub finished: bool,
    /// Training seconds at the last step.
    pub elapsed_s: f64,
}

impl RunSummary {
    /// A `run_start` (or `vision_run_start`) at `time`: the first one dates the run.
    fn started(
        &mut self,
        time: f64,
        id: String,
        recipe: &str,
        preset: Option<String>,
        n_params: usize,
    ) {
        if self.started == 0.0 {
            self.started = time;
        }
        self.id = id;
        self.recipe = recipe.to_string();
        self.preset = preset;
        self.n_params = n_params;
    }
}

/// Loss over steps of one run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Curve {
    /// The run's name in the legend.
    pub label: String,
    /// `(step, loss)` of every training step.
    pub train: Vec<(usize, f64)>,
    /// `(step, loss)` of every held-out evaluation.
    pub eval: Vec<(usize, f64)>,
}

/// Summary of the run in `run_dir` (its `events.jsonl`).
pub fn summarize(run_dir: &Path) -> Result<RunSummary, TrainError> {
    let records = read_events(&run_dir.join("events.jsonl"))?;
    let mut s = RunSummary {
        id: run_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        recipe: String::new(),
        preset: None,
        n_params: 0,
        started: 0.0,
        steps_done: 0,
        steps_total: 0,
        loss: None,
        eval_loss: None,
        finished: false,
        elapsed_s: 0.0,
    };
    for r in records {
        match r.event {
            Event::RunStart {
                run_id,
                config,
                n_params,
                ..
            } => {
                let preset = config.preset.map(|p| format!("{p:?}").to_lowercase());
                s.started(r.time, run_id, config.recipe.name(), preset, n_params);
                s.steps_total = config.optim.steps;
            }
            Event::VisionRunStart {
                run_id,
                config,
                n_params,
                ..
            } => {
                let recipe = match config.base {
                    Some(_) => "vit-fine-tune",
                    None => "vit",
                };
                s.started(r.time, run_id, recipe, None, n_params);
                s.steps_total = config.optim.steps;
            }
            Event::Step {
                step,
                loss,
                elapsed_s,
                ..
            } => {
                s.steps_done = step;
                s.loss = Some(loss);
                s.elapsed_s = elapsed_s;
            }
            Event::Eval { loss, .. } => s.eval_loss = Some(loss),
            Event::RunEnd { .. } => s.finished = true,
            _ => {}
        }
    }
    Ok(s)
}

/// The loss curves of the run in `run_dir`. A resumed run logs each step once.
pub fn curve(run_dir: &Path, label: &str) -> Result<Curve, TrainError> {
    let mut c = Curve {
        label: label.to_string(),
        ..Default::default()
    };
    for r in read_events(&run_dir.join("events.jsonl"))? {
        match r.event {
            Event::Step { step, loss, .. } => c.train.push((step, loss)),
            Event::Eval { step, loss, .. } => c.eval.push((step, loss)),
            _ => {}
        }
    }
    Ok(c)
}

/// A self-contained SVG chart of the curves: training loss as lines, held-out loss as dots, one
/// colour per run, linear axes from 0.
pub fn loss_svg(curves: &[Curve]) -> String {
    const W: f64 = 800.0;
    const H: f64 = 480.0;
    // Margins: left (tick labels), right (legend), top, bottom (axis label).
    const L: f64 = 64.0;
    const R: f64 = 180.0;
    const T: f64 = 24.0;
    const B: f64 = 48.0;
    const COLORS: [&str; 8] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    ];
    let points = curves.iter().flat_map(|c| c.train.iter().chain(&c.eval));
    let max_step = points.clone().map(|p| p.0).max().unwrap_or(1).max(1) as f64;
    let max_loss = points
        .map(|p| p.1)
        .filter(|l| l.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let (x_max, y_max) = (nice_ceiling(max_step), nice_ceiling(max_loss));
    let x = |step: f64| L + (W - L - R) * step / x_max;
    let y = |loss: f64| H - B - (H - T - B) * loss.clamp(0.0, y_max) / y_max;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    for i in 0..=5 {
        let (sx, ly) = (x_max * i as f64 / 5.0, y_max * i as f64 / 5.0);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#ddd"/><text x="{tx}" y="{ty}" text-anchor="end">{ly}</text>"##,
            x0 = L,
            x1 = W - R,
            y0 = y(ly),
            tx = L - 6.0,
            ty = y(ly) + 4.0,
            ly = trim(ly),
        );
        let _ = writeln!(
            svg,
            r##"<line x1="{xs}" y1="{y0}" x2="{xs}" y2="{y1}" stroke="#ddd"/><text x="{xs}" y="{ty}" text-anchor="middle">{sx}</text>"##,
            xs = x(sx),
            y0 = T,
            y1 = H - B,
            ty = H - B + 16.0,
            sx = trim(sx),
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">loss (nats/token)</text>"#,
        (L + W - R) / 2.0,
        H - 12.0,
        (T + H - B) / 2.0,
        (T + H - B) / 2.0,
    );
    for (i, c) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let line: Vec<String> = c
            .train
            .iter()
            .map(|&(s, l)| format!("{:.1},{:.1}", x(s as f64), y(l)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
            line.join(" ")
        );
        for &(s, l) in &c.eval {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}" stroke="white"/>"#,
                x(s as f64),
                y(l)
            );
        }
        let ly = T + 16.0 + 20.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{x0}" y1="{ly}" x2="{x1}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{tx}" y="{ty}">{}</text>"#,
            escape(&c.label),
            x0 = W - R + 12.0,
            x1 = W - R + 32.0,
            tx = W - R + 38.0,
            ty = ly + 4.0,
        );
    }
    let note_y = T + 16.0 + 20.0 * curves.len() as f64 + 8.0;
    for (i, note) in ["lines: training loss", "dots: held-out loss"]
        .iter()
        .enumerate()
    {
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" fill="#555">{note}</text>"##,
            W - R + 12.0,
            note_y + 16.0 * i as f64
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The smallest round number (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of ten) at
/// least `v`: an axis end with five even ticks.
fn nice_ceiling(v: f64) -> f64 {
    let p = 10f64.powf(v.log10().floor());
    [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&c| c >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * p)
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(7.2), 8.0);
        assert_eq!(nice_ceiling(120.0), 120.0);
        assert_eq!(nice_ceiling(121.0), 150.0);
        assert_eq!(nice_ceiling(0.45), 0.5);
        assert_eq!(nice_ceiling(2.0), 2.0);
    }

    #[test]
    fn svg_has_one_line_per_run_and_a_dot_per_eval() {
        let curves = vec![
            Curve {
                label: "a".into(),
                train: vec![(1, 7.0), (2, 5.0), (3, 4.0)],
                eval: vec![(2, 5.5)],
            },
            Curve {
                label: "b<&>".into(),
                train: vec![(1, 6.0), (2, 3.0)],
                eval: vec![],
            },
        ];
        let svg = loss_svg(&curves);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 1);
        assert!(svg.contains("b&lt;&amp;&gt;"), "labels are escaped");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
