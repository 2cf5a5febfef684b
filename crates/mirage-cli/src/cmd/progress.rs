//! Progress on stderr: bars with an ETA for steps that count (chunks,
//! elements), spinners with the elapsed time for steps that do not (loading
//! a model). indicatif hides both when stderr is not a terminal, so a pipe
//! or a log file gets no escape codes.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Whether stderr may carry ANSI colours: a terminal, and `NO_COLOR` unset
/// or empty (<https://no-color.org>).
pub fn stderr_colours() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// A bar over `total` units with position, elapsed time and ETA.
pub fn bar(prefix: &str, total: u64) -> ProgressBar {
    let style = ProgressStyle::with_template(
        "{prefix:>15} [{bar:30}] {pos}/{len} {elapsed} eta {eta} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    ProgressBar::new(total)
        .with_style(style)
        .with_prefix(prefix.to_string())
}

/// A spinner for a step of unknown length (ticks by itself).
pub fn spinner(message: String) -> ProgressBar {
    let style = ProgressStyle::with_template("{spinner} {msg} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner());
    let s = ProgressBar::new_spinner()
        .with_style(style)
        .with_message(message);
    s.enable_steady_tick(Duration::from_millis(120));
    s
}

/// Runs `step` under a spinner showing `message` and the elapsed time, and
/// logs how long it took (`-v`).
pub fn during<T>(message: String, step: impl FnOnce() -> T) -> T {
    let s = spinner(message.clone());
    let t = std::time::Instant::now();
    let out = step();
    s.finish_and_clear();
    tracing::info!("{message}: {:.1} s", t.elapsed().as_secs_f64());
    out
}
