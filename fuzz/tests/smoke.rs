//! The fuzz targets in CI, in seconds: every target replays its seeds, its
//! committed corpus (`fuzz/corpus/NAME/`) and its regressions
//! (`fuzz/regressions/NAME/`: inputs that once crashed it), then runs a few
//! thousand mutants. The long runs are `cargo xtask fuzz` (fuzz/README.md).
//! This binary links the harness's capped allocator: an allocation over
//! 1 GiB aborts it.

use std::path::PathBuf;
use std::time::Duration;

use mirage_fuzz::engine::{self, Options};
use mirage_fuzz::targets;

fn dirs(name: &str) -> Vec<PathBuf> {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    vec![
        d.join("corpus").join(name),
        d.join("regressions").join(name),
    ]
}

#[test]
fn every_target_survives_its_corpus_and_a_short_run() {
    let all = targets::all();
    assert!(all.len() >= 4, "targets: {all:?}");
    for t in all {
        let opts = Options {
            execs: 2_000,
            max_time: Some(Duration::from_secs(5)),
            seed: 1,
            corpus_dirs: dirs(t.name),
            save_dir: None,
            status_every: None,
        };
        match engine::fuzz(&t, &opts, None) {
            Ok(r) => eprintln!(
                "{}: {} executions in {:.2} s, corpus {}, peak heap {:.1} MiB",
                t.name,
                r.execs,
                r.secs,
                r.corpus,
                r.peak_live_bytes as f64 / (1 << 20) as f64
            ),
            Err(f) => panic!(
                "{}: panic {:?} on input {:?} (save it to fuzz/regressions/{}/ and replay: cargo run --release -p mirage-fuzz -- replay {} FILE)",
                t.name,
                f.message,
                String::from_utf8_lossy(&f.input),
                t.name,
                t.name
            ),
        }
    }
}

#[test]
fn every_regression_input_runs_clean() {
    for t in targets::all() {
        for dir in dirs(t.name) {
            for (path, bytes) in engine::read_dir_inputs(&dir) {
                if let Err(m) = engine::run_one(&t, &bytes) {
                    panic!("{}: {} panics: {m}", t.name, path.display());
                }
            }
        }
    }
}

#[test]
fn the_allocation_cap_refuses_what_would_exceed_it() {
    // A fallible request over the cap is refused, and counted; nothing aborts.
    let before = mirage_fuzz::alloc::refused_count();
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(mirage_fuzz::alloc::cap() + 1).is_err());
    assert_eq!(mirage_fuzz::alloc::refused_count(), before + 1);
    assert!(mirage_fuzz::alloc::last_refused() > mirage_fuzz::alloc::cap() as u64);
    assert!(v.try_reserve_exact(1 << 20).is_ok());
}
