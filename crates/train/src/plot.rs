//! Line charts as PNG without a plotting crate (the digits-only font of [`crate::exit::plot_histogram`], [`draw_digits`]): panels
//! side by side, each with its own y range, dotted reference lines, and one coloured polyline per series.

use crate::exit::{draw_digits, write_png};
use crate::TrainError;
use std::path::Path;

/// One panel of [`plot_lines`]: x from 0 to `x_max`, y from `y_min` to `y_max` (values outside are clipped),
/// integer tick labels every `x_tick` / `y_tick` (as `label_scale × value`, e.g. 100 for percent).
pub struct Panel {
    pub x_max: f64,
    pub x_tick: f64,
    pub y_min: f64,
    pub y_max: f64,
    pub y_tick: f64,
    pub label_scale: f64,
    /// Dotted horizontal lines (a bar to meet, the dense value).
    pub references: Vec<f64>,
    /// Points `(x, y)` in order and their colour.
    pub series: Vec<(Vec<(f64, f64)>, [u8; 3])>,
}

const W: usize = 360;
const H: usize = 240;
const MARGIN: usize = 40;

/// Draws `panels` left to right into one PNG at `path`.
pub fn plot_lines(panels: &[Panel], path: &Path) -> Result<(), TrainError> {
    let (pw, ph) = (W + 2 * MARGIN, H + 2 * MARGIN);
    let (w, h) = (pw * panels.len().max(1), ph);
    let mut img = vec![255u8; w * h * 3];
    let mut put = |x: i64, y: i64, c: [u8; 3]| {
        if x >= 0 && y >= 0 && (x as usize) < w && (y as usize) < h {
            let i = (y as usize * w + x as usize) * 3;
            img[i..i + 3].copy_from_slice(&c);
        }
    };
    for (p, panel) in panels.iter().enumerate() {
        let x0 = (p * pw + MARGIN) as i64;
        let y0 = MARGIN as i64;
        let px = |x: f64| x0 + ((x / panel.x_max).clamp(0.0, 1.0) * W as f64).round() as i64;
        let py = |y: f64| {
            let f = ((y - panel.y_min) / (panel.y_max - panel.y_min)).clamp(0.0, 1.0);
            y0 + H as i64 - (f * H as f64).round() as i64
        };
        for x in 0..=W as i64 {
            put(x0 + x, y0 + H as i64, [0, 0, 0]);
        }
        for y in 0..=H as i64 {
            put(x0, y0 + y, [0, 0, 0]);
        }
        for &r in &panel.references {
            for x in (0..=W as i64).step_by(4) {
                put(x0 + x, py(r), [150, 150, 150]);
            }
        }
        let digits = |value: f64, x: i64, y: i64, put: &mut dyn FnMut(i64, i64, [u8; 3])| {
            let s = format!("{}", (value * panel.label_scale).round() as i64);
            draw_digits(&s, x, y, &mut |x, y| put(x, y, [0, 0, 0]));
        };
        let mut t = 0.0;
        while t <= panel.x_max + 1e-9 {
            digits(t, px(t) - 4, y0 + H as i64 + 6, &mut put);
            t += panel.x_tick;
        }
        let mut t = (panel.y_min / panel.y_tick).ceil() * panel.y_tick;
        while t <= panel.y_max + 1e-9 {
            digits(t, x0 - 30, py(t) - 5, &mut put);
            put(x0 - 3, py(t), [0, 0, 0]);
            put(x0 - 2, py(t), [0, 0, 0]);
            t += panel.y_tick;
        }
        for (points, colour) in &panel.series {
            for pair in points.windows(2) {
                let (a, b) = ((px(pair[0].0), py(pair[0].1)), (px(pair[1].0), py(pair[1].1)));
                let steps = (b.0 - a.0).abs().max((b.1 - a.1).abs()).max(1);
                for s in 0..=steps {
                    let x = a.0 + (b.0 - a.0) * s / steps;
                    let y = a.1 + (b.1 - a.1) * s / steps;
                    put(x, y, *colour);
                    put(x, y + 1, *colour);
                }
            }
            for &(x, y) in points {
                for dx in -2..=2 {
                    for dy in -2..=2 {
                        put(px(x) + dx, py(y) + dy, *colour);
                    }
                }
            }
        }
    }
    write_png(path, w, h, &img)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_of_the_panels_size_with_the_series_colour() {
        let dir = std::env::temp_dir().join(format!("specee-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.png");
        let panel = |c| Panel {
            x_max: 0.6,
            x_tick: 0.1,
            y_min: 0.0,
            y_max: 1.0,
            y_tick: 0.25,
            label_scale: 100.0,
            references: vec![0.5],
            series: vec![(vec![(0.0, 0.0), (0.3, 0.5), (0.6, 1.0)], c)],
        };
        plot_lines(&[panel([200, 0, 0]), panel([0, 0, 200])], &path).unwrap();
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width as usize, info.height as usize), (2 * (W + 2 * MARGIN), H + 2 * MARGIN));
        let has = |c: [u8; 3]| buf.chunks_exact(3).any(|p| p == c);
        assert!(has([200, 0, 0]) && has([0, 0, 200]) && has([150, 150, 150]));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
