//! Counters, gauges and histograms rendered in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// A histogram with fixed upper bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    total: AtomicU64,
}

const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            total: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, secs: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| secs <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros
            .fetch_add((secs.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// Mean of the observations, if any.
    pub fn mean(&self) -> Option<f64> {
        let n = self.total.load(Ordering::Relaxed);
        (n > 0).then(|| self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6 / n as f64)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let total = self.total.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {total}");
    }
}

/// Connections the server closed, by reason.
#[derive(Debug, Default)]
pub struct ClosedConnections {
    /// A request head did not arrive within the header timeout.
    pub header_timeout: AtomicU64,
    /// No new request within the idle timeout.
    pub idle_timeout: AtomicU64,
    /// Closed to make room for a new connection at the limit.
    pub evicted: AtomicU64,
    /// Refused (503) at the limit: every connection had a request in progress.
    pub refused: AtomicU64,
}

/// Everything /metrics reports; shared by the HTTP handlers and the scheduler.
#[derive(Debug)]
pub struct Metrics {
    /// HTTP requests by (path, status).
    pub requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Prompt tokens run (completed or not).
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub completion_tokens: AtomicU64,
    /// Requests waiting for a sequence slot.
    pub queue_depth: AtomicI64,
    /// Sequences holding a KV slot.
    pub active_sequences: AtomicI64,
    /// Sequences dropped because their client went away.
    pub cancelled: AtomicU64,
    /// Requests answered 429 because the queue was full.
    pub rejected: AtomicU64,
    /// Generated tokens per second over the last few seconds (f64 bits).
    pub tokens_per_second: AtomicU64,
    /// Forward passes run.
    pub steps: AtomicU64,
    /// From arrival to the last token.
    pub request_latency: Histogram,
    /// From arrival to the first generated text.
    pub time_to_first_token: Histogram,
    /// From arrival to getting a sequence slot.
    pub queue_wait: Histogram,
    /// One forward pass with sampling.
    pub step_latency: Histogram,
    /// Open TCP connections.
    pub open_connections: AtomicI64,
    /// Connections accepted.
    pub connections_accepted: AtomicU64,
    /// Connections the server closed, by reason.
    pub connections_closed: ClosedConnections,
    /// Requests hyper could not parse (answered 400, 414 or 431).
    pub protocol_errors: AtomicU64,
    /// Sequence slots in all.
    pub max_batch: usize,
    /// The backend serving the model (set once it is loaded).
    pub backend: std::sync::OnceLock<String>,
}

impl Metrics {
    /// Zeroed metrics for a server with `max_batch` sequence slots.
    pub fn new(max_batch: usize) -> Metrics {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            queue_depth: AtomicI64::new(0),
            active_sequences: AtomicI64::new(0),
            cancelled: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            tokens_per_second: AtomicU64::new(0f64.to_bits()),
            steps: AtomicU64::new(0),
            request_latency: Histogram::new(LATENCY_BOUNDS),
            time_to_first_token: Histogram::new(LATENCY_BOUNDS),
            queue_wait: Histogram::new(LATENCY_BOUNDS),
            step_latency: Histogram::new(LATENCY_BOUNDS),
            open_connections: AtomicI64::new(0),
            connections_accepted: AtomicU64::new(0),
            connections_closed: ClosedConnections::default(),
            protocol_errors: AtomicU64::new(0),
            max_batch,
            backend: std::sync::OnceLock::new(),
        }
    }

    /// Counts one answered HTTP request.
    pub fn count_request(&self, path: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((path.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(out, "# HELP mirage_requests_total HTTP requests answered, by path and status.\n# TYPE mirage_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((path, code), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "mirage_requests_total{{path=\"{path}\",code=\"{code}\"}} {n}"
                );
            }
        }
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "mirage_prompt_tokens_total",
            "Prompt tokens run through the model.",
            ld(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "mirage_completion_tokens_total",
            "Tokens generated.",
            ld(&self.completion_tokens),
        );
        counter(
            &mut out,
            "mirage_cancelled_sequences_total",
            "Sequences freed because the client disconnected.",
            ld(&self.cancelled),
        );
        counter(
            &mut out,
            "mirage_rejected_requests_total",
            "Requests answered 429 because the queue was full.",
            ld(&self.rejected),
        );
        counter(
            &mut out,
            "mirage_forward_steps_total",
            "Batched forward passes.",
            ld(&self.steps),
        );
        gauge(
            &mut out,
            "mirage_queue_depth",
            "Requests waiting for a sequence slot.",
            self.queue_depth.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "mirage_active_sequences",
            "Sequences holding a KV cache slot.",
            self.active_sequences.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "mirage_open_connections",
            "Open TCP connections.",
            self.open_connections.load(Ordering::Relaxed).to_string(),
        );
        counter(
            &mut out,
            "mirage_connections_accepted_total",
            "TCP connections accepted.",
            ld(&self.connections_accepted),
        );
        let c = &self.connections_closed;
        let _ = writeln!(out, "# HELP mirage_connections_closed_total Connections the server closed, by reason.\n# TYPE mirage_connections_closed_total counter");
        for (reason, v) in [
            ("header_timeout", &c.header_timeout),
            ("idle_timeout", &c.idle_timeout),
            ("evicted", &c.evicted),
            ("refused", &c.refused),
        ] {
            let _ = writeln!(
                out,
                "mirage_connections_closed_total{{reason=\"{reason}\"}} {}",
                ld(v)
            );
        }
        counter(
            &mut out,
            "mirage_protocol_errors_total",
            "Requests that were not valid HTTP (answered 400, 414 or 431).",
            ld(&self.protocol_errors),
        );
        gauge(
            &mut out,
            "mirage_max_batch",
            "Sequence slots in all.",
            self.max_batch.to_string(),
        );
        if let Some(b) = self.backend.get() {
            let _ = writeln!(
                out,
                "# HELP mirage_backend_info The backend serving the model (label), always 1.\n# TYPE mirage_backend_info gauge\nmirage_backend_info{{backend=\"{b}\"}} 1"
            );
        }
        gauge(
            &mut out,
            "mirage_tokens_per_second",
            "Generated tokens per second over the last seconds.",
            format!("{:.3}", f64::from_bits(ld(&self.tokens_per_second))),
        );
        self.request_latency.render(
            &mut out,
            "mirage_request_duration_seconds",
            "From arrival to the last generated token.",
        );
        self.time_to_first_token.render(
            &mut out,
            "mirage_time_to_first_token_seconds",
            "From arrival to the first generated text.",
        );
        self.queue_wait.render(
            &mut out,
            "mirage_queue_wait_seconds",
            "From arrival to getting a sequence slot.",
        );
        self.step_latency.render(
            &mut out,
            "mirage_step_duration_seconds",
            "One batched forward pass with sampling.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::new(4);
        m.request_latency.observe(0.003);
        m.request_latency.observe(0.2);
        m.request_latency.observe(500.0);
        m.count_request("/v1/models", 200);
        let text = m.render();
        assert!(
            text.contains("mirage_request_duration_seconds_bucket{le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("mirage_request_duration_seconds_bucket{le=\"0.25\"} 2\n"));
        assert!(text.contains("mirage_request_duration_seconds_bucket{le=\"120\"} 2\n"));
        assert!(text.contains("mirage_request_duration_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("mirage_request_duration_seconds_count 3\n"));
        assert!(text.contains("mirage_requests_total{path=\"/v1/models\",code=\"200\"} 1\n"));
        assert!(text.contains("mirage_max_batch 4\n"));
    }
}
