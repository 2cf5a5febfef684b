//! Files written whole or not at all, whose temporaries a later run cleans
//! up when the writer died.
//!
//! [`AtomicFile`] writes to `.NAME.tmp-PID` next to the destination, holds an
//! exclusive `flock` on it while it writes, fsyncs and renames it over the
//! destination; dropped without [`AtomicFile::commit`] it removes the
//! temporary. A writer killed with SIGKILL leaves the temporary behind
//! (up to a whole model); the next [`AtomicFile::create`] for the same
//! destination removes every temporary of that destination whose lock is
//! free and whose PID is not a live process ([`remove_stale_temporaries`]).
//! The lock is what proves the owner is gone (it dies with the process,
//! across PID namespaces); the PID check covers the instant between a
//! writer creating its temporary and locking it.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// The temporary `dest` is written under by process `pid`.
pub fn temp_path(dest: &Path, pid: u32) -> PathBuf {
    let name = dest.file_name().unwrap_or_default().to_string_lossy();
    dest.with_file_name(format!(".{name}.tmp-{pid}"))
}

/// The PID in `file_name` when it is a temporary of `dest_name` in this
/// module's naming (`.NAME.tmp-PID`, or `NAME.tmp-PID` as older versions
/// named them).
fn temp_owner(file_name: &str, dest_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix('.').unwrap_or(file_name);
    let pid = rest.strip_prefix(dest_name)?.strip_prefix(".tmp-")?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Whether no process holds a lock on `path` and `pid` is not a live
/// process: the owner of a temporary is gone. Always false where locks or
/// PIDs cannot be checked (not Unix): nothing is removed there.
pub fn owner_is_gone(path: &Path, pid: Option<u32>) -> bool {
    #[cfg(unix)]
    {
        if pid.is_some_and(process_is_alive) {
            return false;
        }
        match File::open(path) {
            // Dropping the file releases the probe's own lock.
            Ok(f) => try_lock_exclusive(&f).unwrap_or(false),
            Err(_) => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (path, pid);
        false
    }
}

/// Whether `pid` names a live process (one this process may see).
#[cfg(unix)]
pub fn process_is_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Takes an exclusive `flock` on `file` without waiting: `Ok(false)` when
/// another open file holds one.
#[cfg(unix)]
pub fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a file descriptor this `File` owns.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Removes every temporary of `dest` ([`temp_path`], any PID) whose owner
/// is gone ([`owner_is_gone`]); returns the paths removed. Temporaries of
/// live writers, and files of other names, are left alone.
pub fn remove_stale_temporaries(dest: &Path) -> io::Result<Vec<PathBuf>> {
    let Some(dest_name) = dest.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(Vec::new());
    };
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(pid) = temp_owner(&name.to_string_lossy(), &dest_name) else {
            continue;
        };
        let path = entry.path();
        if entry.file_type()?.is_file()
            && owner_is_gone(&path, Some(pid))
            && fs::remove_file(&path).is_ok()
        {
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A file being written under a temporary name (see the module doc).
#[derive(Debug)]
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Removes stale temporaries of `dest`, then creates and locks this
    /// process's temporary for it.
    pub fn create(dest: impl AsRef<Path>) -> io::Result<AtomicFile> {
        let dest = dest.as_ref().to_path_buf();
        // Best effort: a folder that cannot be listed still gets the write.
        let _ = remove_stale_temporaries(&dest);
        let tmp = temp_path(&dest, std::process::id());
        // Ours by PID: a leftover of an earlier writer in this process.
        let _ = fs::remove_file(&tmp);
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .open(&tmp)?;
        #[cfg(unix)]
        if !try_lock_exclusive(&file)? {
            return Err(io::Error::other(format!(
                "{} is locked by another writer",
                tmp.display()
            )));
        }
        Ok(AtomicFile {
            dest,
            tmp,
            file: Some(file),
        })
    }

    /// The open temporary file.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("open until commit")
    }

    /// The temporary's path.
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// The destination.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Syncs the temporary, renames it over the destination and syncs the
    /// folder (best effort: not every platform opens folders).
    pub fn commit(mut self) -> io::Result<()> {
        let file = self.file.take().expect("open until commit");
        file.sync_all()?;
        fs::rename(&self.tmp, &self.dest)?;
        drop(file);
        let dir = match self.dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_are_recognised_by_name_only_for_their_destination() {
        assert_eq!(temp_owner(".m.gguf.tmp-123", "m.gguf"), Some(123));
        assert_eq!(temp_owner("m.gguf.tmp-123", "m.gguf"), Some(123));
        assert_eq!(temp_owner(".m.gguf.tmp-", "m.gguf"), None);
        assert_eq!(temp_owner(".m.gguf.tmp-12x", "m.gguf"), None);
        assert_eq!(temp_owner(".other.gguf.tmp-1", "m.gguf"), None);
        assert_eq!(temp_owner("m.gguf", "m.gguf"), None);
        assert_eq!(
            temp_path(Path::new("d/m.gguf"), 7),
            PathBuf::from("d/.m.gguf.tmp-7")
        );
    }

    #[cfg(unix)]
    #[test]
    fn stale_temporaries_go_live_and_foreign_files_stay() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("m.gguf");
        // A PID that is certainly dead: a child that has exited and been reaped.
        let dead = {
            let mut c = std::process::Command::new("true").spawn().unwrap();
            let pid = c.id();
            c.wait().unwrap();
            pid
        };
        let stale = temp_path(&dest, dead);
        let stale_old_style = dir.path().join(format!("m.gguf.tmp-{dead}"));
        fs::write(&stale, b"half a model").unwrap();
        fs::write(&stale_old_style, b"half a model").unwrap();
        // A live writer (this process) holding its lock.
        let live = temp_path(&dest, std::process::id() + 1_000_000);
        fs::write(&live, b"being written").unwrap();
        let held = File::open(&live).unwrap();
        assert!(try_lock_exclusive(&held).unwrap());
        // Not ours to touch.
        let foreign = dir.path().join("notes.txt.tmp-1");
        fs::write(&foreign, b"x").unwrap();
        let mut w = AtomicFile::create(&dest).unwrap();
        assert!(!stale.exists() && !stale_old_style.exists());
        assert!(live.exists() && foreign.exists());
        use std::io::Write;
        w.file().write_all(b"whole").unwrap();
        assert!(w.temp_path().exists());
        w.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"whole");
        drop(held);
        // Its lock gone (and its PID never alive), the last one goes too.
        assert_eq!(remove_stale_temporaries(&dest).unwrap(), vec![live.clone()]);
        // Dropped without commit: no temporary left, destination untouched.
        let w = AtomicFile::create(&dest).unwrap();
        let tmp = w.temp_path().to_path_buf();
        drop(w);
        assert!(!tmp.exists());
        assert_eq!(fs::read(&dest).unwrap(), b"whole");
    }
}
