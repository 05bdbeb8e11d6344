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
//! | `specee_queue_wait_seconds`, `specee_time_to_first_token_seconds` | histogram | |
//! | `specee_inter_token_latency_seconds` | histogram | (batching scheduler only) |
//! | `specee_batch_rows`, `specee_batch_sequences` | histogram | rows / requests per forward (batching only) |
//! | `specee_batch_step_seconds` | histogram | seconds of one batched step: forward and heads (batching only) |
//! | `specee_kv_budget_tokens`, `specee_kv_reserved_tokens` | gauge | the KV pool (batching only) |
//! | `specee_prefix_cache_tokens`, `specee_prefix_cache_hit_tokens_total`, `specee_prefix_cache_lookups_total` | gauge, counter, counter | |
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

/// Latency buckets, seconds (queue wait, time to first token, inter-token latency).
const SECONDS_BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Rows per batched forward.
const ROWS_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
/// Requests per batched forward.
const SEQUENCES_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// A Prometheus histogram with fixed bucket bounds.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations `<=` each bound (not cumulative; summed when rendered), then above the last.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// The value below which a share `q` of observations fell, as the upper bound of its bucket (`+Inf` past the
    /// last); `None` before any observation.
    pub fn quantile_bound(&self, q: f64) -> Option<f64> {
        let want = (q * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= want && self.count > 0 {
                return Some(self.bounds.get(i).copied().unwrap_or(f64::INFINITY));
            }
        }
        None
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&header(name, "histogram", help));
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            out.push_str(&format!("{name}_bucket{{le=\"{bound}\"}} {cumulative}\n"));
        }
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n", self.count));
        out.push_str(&format!("{name}_sum {}\n{name}_count {}\n", self.sum, self.count));
    }
}

/// Which latency or batch histogram an observation goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observe {
    /// Seconds from admission to the start of generation.
    QueueWait,
    /// Seconds from admission to the first generated token.
    FirstToken,
    /// Seconds between two consecutive tokens of one request.
    InterToken,
    /// Rows in one batched forward.
    BatchRows,
    /// Requests in one batched forward.
    BatchSequences,
    /// Seconds of one batched step: drafting, the forward, the heads and handing out the tokens (admission and
    /// intake not counted).
    BatchStep,
}

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

#[derive(Clone)]
struct Counters {
    requests: BTreeMap<(&'static str, u16), u64>,
    modes: BTreeMap<Mode, ModeCounters>,
    queue_wait: Histogram,
    first_token: Histogram,
    inter_token: Histogram,
    batch_rows: Histogram,
    batch_sequences: Histogram,
    batch_step: Histogram,
    prefix_hit_tokens: u64,
    prefix_lookups: u64,
}

impl Counters {
    fn histogram_mut(&mut self, what: Observe) -> &mut Histogram {
        match what {
            Observe::QueueWait => &mut self.queue_wait,
            Observe::FirstToken => &mut self.first_token,
            Observe::InterToken => &mut self.inter_token,
            Observe::BatchRows => &mut self.batch_rows,
            Observe::BatchSequences => &mut self.batch_sequences,
            Observe::BatchStep => &mut self.batch_step,
        }
    }
}

/// The server's metrics; shared by handlers and workers.
pub struct Metrics {
    counters: Mutex<Counters>,
    /// Requests waiting for a worker.
    pub queued: AtomicUsize,
    /// Requests a worker is running.
    pub in_flight: AtomicUsize,
    /// Tokens of KV cache reserved by admitted requests (batching scheduler).
    pub kv_reserved: AtomicUsize,
    /// Tokens the KV pool may reserve in all (0: no pool, per-request caches).
    pub kv_budget: AtomicUsize,
    /// Tokens held by the prefix cache.
    pub prefix_cache_tokens: AtomicUsize,
    queue_capacity: usize,
    parallel: usize,
    n_layers: usize,
}

impl Metrics {
    pub fn new(queue_capacity: usize, parallel: usize, n_layers: usize) -> Metrics {
        let counters = Counters {
            requests: BTreeMap::new(),
            modes: Mode::ALL.iter().map(|&m| (m, ModeCounters::default())).collect(),
            queue_wait: Histogram::new(&SECONDS_BUCKETS),
            first_token: Histogram::new(&SECONDS_BUCKETS),
            inter_token: Histogram::new(&SECONDS_BUCKETS),
            batch_rows: Histogram::new(&ROWS_BUCKETS),
            batch_sequences: Histogram::new(&SEQUENCES_BUCKETS),
            batch_step: Histogram::new(&SECONDS_BUCKETS),
            prefix_hit_tokens: 0,
            prefix_lookups: 0,
        };
        Metrics {
            counters: Mutex::new(counters),
            queued: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            kv_reserved: AtomicUsize::new(0),
            kv_budget: AtomicUsize::new(0),
            prefix_cache_tokens: AtomicUsize::new(0),
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

    /// Adds an observation to one of the latency or batch histograms.
    pub fn observe(&self, what: Observe, value: f64) {
        self.counters().histogram_mut(what).observe(value);
    }

    /// Counts one prefix-cache lookup that reused `hit_tokens` prompt tokens (0: a miss).
    pub fn record_prefix_lookup(&self, hit_tokens: usize) {
        let mut c = self.counters();
        c.prefix_lookups += 1;
        c.prefix_hit_tokens += hit_tokens as u64;
    }

    /// A copy of one histogram (for tests and summaries).
    pub fn histogram(&self, what: Observe) -> Histogram {
        self.counters().histogram_mut(what).clone()
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
        // A copy, so that rendering does not hold the lock.
        let c = self.counters().clone();
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
        c.queue_wait.render(
            "specee_queue_wait_seconds",
            "Seconds from admission to the start of generation.",
            &mut out,
        );
        c.first_token.render(
            "specee_time_to_first_token_seconds",
            "Seconds from admission to the first generated token.",
            &mut out,
        );
        c.inter_token.render(
            "specee_inter_token_latency_seconds",
            "Seconds between consecutive tokens of one request (batching scheduler).",
            &mut out,
        );
        c.batch_rows.render("specee_batch_rows", "Rows (tokens) per batched forward.", &mut out);
        c.batch_sequences.render("specee_batch_sequences", "Requests per batched forward.", &mut out);
        c.batch_step.render(
            "specee_batch_step_seconds",
            "Seconds of one batched step: drafting, the forward and the heads.",
            &mut out,
        );
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            out.push_str(&header(name, "gauge", help));
            out.push_str(&format!("{name} {v}\n"));
        };
        gauge(
            &mut out,
            "specee_kv_budget_tokens",
            "Tokens of KV cache the pool may reserve (--kv-budget; 0 without batching).",
            self.kv_budget.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "specee_kv_reserved_tokens",
            "Tokens of KV cache reserved by admitted requests.",
            self.kv_reserved.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "specee_prefix_cache_tokens",
            "Tokens held by the prefix cache.",
            self.prefix_cache_tokens.load(Ordering::Relaxed),
        );
        out.push_str(&header(
            "specee_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens reused from the prefix cache instead of being computed.",
        ));
        out.push_str(&format!("specee_prefix_cache_hit_tokens_total {}\n", c.prefix_hit_tokens));
        out.push_str(&header("specee_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache."));
        out.push_str(&format!("specee_prefix_cache_lookups_total {}\n", c.prefix_lookups));
        out
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
            DecodeStats { tokens: 4, layers: 120, steps: 4, tree: None },
            Some(12.0),
        );
        m.observe(Observe::FirstToken, 0.03);
        m.observe(Observe::FirstToken, 0.2);
        m.observe(Observe::BatchRows, 3.0);
        m.observe(Observe::BatchStep, 0.02);
        m.record_prefix_lookup(32);
        m.record_prefix_lookup(0);
        let h = m.histogram(Observe::FirstToken);
        assert_eq!((h.quantile_bound(0.5), h.quantile_bound(0.99)), (Some(0.05), Some(0.25)));
        assert_eq!(m.histogram(Observe::InterToken).quantile_bound(0.5), None);
        let text = m.render();
        for line in [
            "specee_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "specee_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "specee_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2",
            "specee_time_to_first_token_seconds_count 2",
            "specee_batch_rows_bucket{le=\"2\"} 0",
            "specee_batch_rows_bucket{le=\"4\"} 1",
            "specee_batch_step_seconds_bucket{le=\"0.01\"} 0",
            "specee_batch_step_seconds_bucket{le=\"0.025\"} 1",
            "specee_prefix_cache_hit_tokens_total 32",
            "specee_prefix_cache_lookups_total 2",
            "specee_kv_reserved_tokens 0",
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
