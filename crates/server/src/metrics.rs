//! Counters behind `GET /metrics`, rendered in Prometheus' text format (version 0.0.4):
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `specee_requests_total` | counter | `endpoint`, `status` |
//! | `specee_prompt_tokens_total`, `specee_generated_tokens_total` | counter | `mode` |
//! | `specee_generations_total` | counter | `mode`, `finish` (`stop`, `length`, `cancelled`, `error`) |
//! | `specee_decode_tokens_per_second` | histogram | `mode` |
//! | `specee_queue_depth`, `specee_requests_in_flight` | gauge | |
//! | `specee_queue_capacity`, `specee_parallel`, `specee_model_layers` | gauge | |
//! | `specee_decode_layers_total`, `specee_decode_steps_total` | counter | `mode` |
//! | `specee_exit_layer_average`, `specee_acceptance_length_average` | gauge | `mode` |
//!
//! The average exit layer is layers executed per generated token (`decode_layers_total / generated_tokens`;
//! dense = the model's layer count); the acceptance length is generated tokens per full-model forward step
//! (`generated_tokens / decode_steps_total`; dense = 1). Every mode is listed from the start, with zeros.

use crate::mode::{DecodeStats, Mode};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Upper bounds of the decode-speed histogram's buckets, tokens/s.
const TOKENS_PER_SECOND_BUCKETS: [f64; 11] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 300.0, 500.0, 1000.0];

/// How a generation ended, for `specee_generations_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    Stop,
    Length,
    Cancelled,
    Error,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Error => "error",
        }
    }
}

#[derive(Clone, Debug, Default)]
struct ModeCounters {
    prompt_tokens: u64,
    stats: DecodeStats,
    outcomes: BTreeMap<Outcome, u64>,
    /// Cumulative counts per bucket of [`TOKENS_PER_SECOND_BUCKETS`], then `+Inf`.
    speed_buckets: [u64; TOKENS_PER_SECOND_BUCKETS.len() + 1],
    speed_sum: f64,
    speed_count: u64,
}

#[derive(Default)]
struct Counters {
    requests: BTreeMap<(&'static str, u16), u64>,
    modes: BTreeMap<Mode, ModeCounters>,
}

/// The server's metrics; shared by handlers and workers.
pub struct Metrics {
    counters: Mutex<Counters>,
    /// Requests waiting for a worker.
    pub queued: AtomicUsize,
    /// Requests a worker is running.
    pub in_flight: AtomicUsize,
    queue_capacity: usize,
    parallel: usize,
    n_layers: usize,
}

impl Metrics {
    pub fn new(queue_capacity: usize, parallel: usize, n_layers: usize) -> Metrics {
        let counters =
            Counters { modes: Mode::ALL.iter().map(|&m| (m, ModeCounters::default())).collect(), ..Default::default() };
        Metrics {
            counters: Mutex::new(counters),
            queued: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            queue_capacity,
            parallel,
            n_layers,
        }
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        // A panic elsewhere cannot leave these counters inconsistent in a way that matters.
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one answered request.
    pub fn record_request(&self, endpoint: &'static str, status: u16) {
        *self.counters().requests.entry((endpoint, status)).or_default() += 1;
    }

    /// Counts one generation that ran (fully or not).
    pub fn record_generation(
        &self,
        mode: Mode,
        outcome: Outcome,
        prompt_tokens: usize,
        stats: DecodeStats,
        decode_tokens_per_s: Option<f64>,
    ) {
        let mut c = self.counters();
        let m = c.modes.entry(mode).or_default();
        m.prompt_tokens += prompt_tokens as u64;
        m.stats.tokens += stats.tokens;
        m.stats.layers += stats.layers;
        m.stats.steps += stats.steps;
        *m.outcomes.entry(outcome).or_default() += 1;
        if let Some(speed) = decode_tokens_per_s.filter(|s| s.is_finite() && *s > 0.0) {
            for (bucket, &bound) in m.speed_buckets.iter_mut().zip(TOKENS_PER_SECOND_BUCKETS.iter()) {
                if speed <= bound {
                    *bucket += 1;
                }
            }
            m.speed_buckets[TOKENS_PER_SECOND_BUCKETS.len()] += 1;
            m.speed_sum += speed;
            m.speed_count += 1;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let c = self.counters().clone_view();
        let mut out = String::new();
        let mut w = |s: String| out.push_str(&s);

        w(header("specee_requests_total", "counter", "HTTP requests answered, by endpoint and status code."));
        for ((endpoint, status), n) in &c.requests {
            w(format!("specee_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}\n"));
        }
        w(header("specee_queue_depth", "gauge", "Requests waiting for a generation slot."));
        w(format!("specee_queue_depth {}\n", self.queued.load(Ordering::Relaxed)));
        w(header("specee_requests_in_flight", "gauge", "Requests being generated."));
        w(format!("specee_requests_in_flight {}\n", self.in_flight.load(Ordering::Relaxed)));
        w(header("specee_queue_capacity", "gauge", "Requests that may wait beyond those in flight (--queue)."));
        w(format!("specee_queue_capacity {}\n", self.queue_capacity));
        w(header("specee_parallel", "gauge", "Requests generated at once (--parallel)."));
        w(format!("specee_parallel {}\n", self.parallel));
        w(header("specee_model_layers", "gauge", "Layers of the served model."));
        w(format!("specee_model_layers {}\n", self.n_layers));

        w(header("specee_prompt_tokens_total", "counter", "Prompt tokens processed, by decoding mode."));
        for (mode, m) in &c.modes {
            w(format!("specee_prompt_tokens_total{{mode=\"{}\"}} {}\n", mode.name(), m.prompt_tokens));
        }
        w(header("specee_generated_tokens_total", "counter", "Tokens generated, by decoding mode."));
        for (mode, m) in &c.modes {
            w(format!("specee_generated_tokens_total{{mode=\"{}\"}} {}\n", mode.name(), m.stats.tokens));
        }
        w(header("specee_generations_total", "counter", "Generations run, by decoding mode and how they ended."));
        for (mode, m) in &c.modes {
            for outcome in [Outcome::Stop, Outcome::Length, Outcome::Cancelled, Outcome::Error] {
                let n = m.outcomes.get(&outcome).copied().unwrap_or(0);
                w(format!("specee_generations_total{{mode=\"{}\",finish=\"{}\"}} {n}\n", mode.name(), outcome.name()));
            }
        }
        w(header("specee_decode_tokens_per_second", "histogram", "Decode speed of each generation, tokens/s."));
        for (mode, m) in &c.modes {
            let name = mode.name();
            for (bound, n) in TOKENS_PER_SECOND_BUCKETS.iter().zip(m.speed_buckets.iter()) {
                w(format!("specee_decode_tokens_per_second_bucket{{mode=\"{name}\",le=\"{bound}\"}} {n}\n"));
            }
            w(format!(
                "specee_decode_tokens_per_second_bucket{{mode=\"{name}\",le=\"+Inf\"}} {}\n",
                m.speed_buckets[TOKENS_PER_SECOND_BUCKETS.len()]
            ));
            w(format!("specee_decode_tokens_per_second_sum{{mode=\"{name}\"}} {}\n", m.speed_sum));
            w(format!("specee_decode_tokens_per_second_count{{mode=\"{name}\"}} {}\n", m.speed_count));
        }
        w(header(
            "specee_decode_layers_total",
            "counter",
            "Layers executed, summed over generated tokens, by decoding mode.",
        ));
        for (mode, m) in &c.modes {
            w(format!("specee_decode_layers_total{{mode=\"{}\"}} {}\n", mode.name(), m.stats.layers));
        }
        w(header("specee_decode_steps_total", "counter", "Full-model forward steps while decoding, by decoding mode."));
        for (mode, m) in &c.modes {
            w(format!("specee_decode_steps_total{{mode=\"{}\"}} {}\n", mode.name(), m.stats.steps));
        }
        w(header(
            "specee_exit_layer_average",
            "gauge",
            "Average layers executed per generated token, by decoding mode (0 before any token).",
        ));
        for (mode, m) in &c.modes {
            w(format!(
                "specee_exit_layer_average{{mode=\"{}\"}} {}\n",
                mode.name(),
                ratio(m.stats.layers, m.stats.tokens)
            ));
        }
        w(header(
            "specee_acceptance_length_average",
            "gauge",
            "Average tokens per full-model forward step, by decoding mode (0 before any token).",
        ));
        for (mode, m) in &c.modes {
            w(format!(
                "specee_acceptance_length_average{{mode=\"{}\"}} {}\n",
                mode.name(),
                ratio(m.stats.tokens, m.stats.steps)
            ));
        }
        out
    }
}

impl Counters {
    /// A copy, so that rendering does not hold the lock.
    fn clone_view(&self) -> Counters {
        Counters { requests: self.requests.clone(), modes: self.modes.clone() }
    }
}

fn header(name: &str, kind: &str, help: &str) -> String {
    format!("# HELP {name} {help}\n# TYPE {name} {kind}\n")
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_all_families() {
        let m = Metrics::new(8, 1, 30);
        m.record_request("/v1/chat/completions", 200);
        m.record_request("/v1/chat/completions", 400);
        m.record_generation(
            Mode::Dense,
            Outcome::Length,
            7,
            DecodeStats { tokens: 4, layers: 120, steps: 4 },
            Some(12.0),
        );
        let text = m.render();
        for line in [
            "specee_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1",
            "specee_prompt_tokens_total{mode=\"dense\"} 7",
            "specee_generated_tokens_total{mode=\"dense\"} 4",
            "specee_generations_total{mode=\"dense\",finish=\"length\"} 1",
            "specee_decode_tokens_per_second_bucket{mode=\"dense\",le=\"10\"} 0",
            "specee_decode_tokens_per_second_bucket{mode=\"dense\",le=\"20\"} 1",
            "specee_decode_tokens_per_second_bucket{mode=\"dense\",le=\"+Inf\"} 1",
            "specee_exit_layer_average{mode=\"dense\"} 30",
            "specee_acceptance_length_average{mode=\"dense\"} 1",
            "specee_queue_depth 0",
            "specee_queue_capacity 8",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Every sample line belongs to a declared family.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            let base = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(text.contains(&format!("# TYPE {base} ")), "{name} has no TYPE line");
        }
    }
}
