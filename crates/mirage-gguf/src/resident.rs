//! How a model file's bytes are held in memory: mapped from the file, or read
//! into anonymous memory that the kernel may back with huge pages.
//!
//! A CPU decode step streams every weight once per token. Through a memory
//! map the weights sit in 4 KiB page-cache pages, about 250,000 a gigabyte,
//! and each costs a TLB miss per token (on a virtual machine a two-level page
//! walk). Read into anonymous memory advised for transparent huge pages
//! (`MADV_HUGEPAGE`, 2 MiB pages on x86-64) the same bytes need 512 times
//! fewer translations: on a 2-vCPU Intel Xeon VM the 1.5B model decoded at
//! 24.5 tok/s from such a copy against 15.1 from the map in one hour, 25.0 against 19.3 in another (docs/BENCHMARKS.md).
//! A map starts at once and shares its pages with other processes; a
//! resident copy costs one read of the file at load. Anonymous memory is also
//! never reclaimed behind the decode's back while it runs (a map's pages are,
//! under memory pressure, and come back through page faults).

use std::fs::File;
use std::io::{self, Read};
use std::ops::Deref;
use std::path::Path;

use memmap2::{Mmap, MmapOptions};

/// How to hold a file's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FileMemory {
    /// A read-only memory map of the file.
    #[default]
    Mapped,
    /// The whole file read into anonymous memory, advised for huge pages
    /// (where the platform has them).
    Resident,
}

impl FileMemory {
    /// `Resident` when a file of `len` bytes fits in the memory the system
    /// reports as available ([`available_bytes`]) with room to spare (a quarter of it, at least
    /// 1 GiB, stays free), else `Mapped`. Systems that report no available
    /// memory (anything but Linux) get `Mapped`.
    pub fn resident_if_it_fits(len: u64) -> FileMemory {
        match available_bytes() {
            Some(avail) if len.saturating_add((avail / 4).max(1 << 30)) <= avail => {
                FileMemory::Resident
            }
            _ => FileMemory::Mapped,
        }
    }

    /// `mapped` or `resident`.
    pub fn as_str(self) -> &'static str {
        match self {
            FileMemory::Mapped => "mapped",
            FileMemory::Resident => "resident",
        }
    }
}

/// Bytes that new allocations can still take, when the system says: the
/// kernel's estimate of memory that can be allocated without swapping
/// (`MemAvailable` in `/proc/meminfo`), lowered to the room left under the
/// process's cgroup v2 limit (`memory.max` minus `memory.current`) when one
/// is set; `None` where neither exists (not Linux).
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let mem = meminfo
        .as_deref()
        .and_then(|m| meminfo_field(m, "MemAvailable"));
    let cgroup = cgroup_room();
    match (mem, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A `Name:  1234 kB` field of `/proc/meminfo`, in bytes.
fn meminfo_field(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find(|l| l.split(':').next() == Some(name))?;
    let mut parts = line.split(':').nth(1)?.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Room under this process's cgroup v2 memory limit, if it has one.
fn cgroup_room() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // cgroup v2: one line `0::/path`.
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let max = std::fs::read_to_string(dir.join("memory.max")).ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max": no limit
    let current: u64 = std::fs::read_to_string(dir.join("memory.current"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(max.saturating_sub(current))
}

/// A file's bytes as [`FileMemory`] says: deref to `[u8]`.
pub struct FileBytes {
    map: Option<Mmap>,
    memory: FileMemory,
}

impl FileBytes {
    /// Opens `path` and holds its bytes as `memory` says. An empty file
    /// gives empty bytes (mapping one fails on some platforms).
    pub fn open(path: &Path, memory: FileMemory) -> io::Result<FileBytes> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        if len == 0 {
            return Ok(FileBytes { map: None, memory });
        }
        let len = usize::try_from(len)
            .map_err(|_| io::Error::other(format!("{len} bytes do not fit this address space")))?;
        let map = match memory {
            // SAFETY: the map is read-only. Like every mmap-based model
            // loader we rely on nobody truncating or rewriting the file while
            // it is open (MIRAGE's writers replace files by rename).
            FileMemory::Mapped => unsafe { Mmap::map(&file)? },
            FileMemory::Resident => read_resident(&mut file, len)?,
        };
        Ok(FileBytes {
            map: Some(map),
            memory,
        })
    }

    /// How the bytes are held.
    pub fn memory(&self) -> FileMemory {
        self.memory
    }
}

/// `len` bytes of `file` in an anonymous map advised for huge pages, then
/// made read-only.
fn read_resident(file: &mut File, len: usize) -> io::Result<Mmap> {
    let mut anon = MmapOptions::new().len(len).map_anon()?;
    // Advice only: where the kernel has no transparent huge pages the copy
    // is still correct, on ordinary pages.
    #[cfg(target_os = "linux")]
    let _ = anon.advise(memmap2::Advice::HugePage);
    let mut at = 0;
    while at < len {
        // Reads of at most 64 MiB, so that a signal interrupts little work.
        let end = len.min(at + (64 << 20));
        match file.read(&mut anon[at..end]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file ended at byte {at} of {len} while it was read"),
                ))
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    anon.make_read_only()
}

impl Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_parse_in_bytes() {
        let m = "MemTotal:       24000000 kB\nMemAvailable:   21000000 kB\nHugePages_Total: 0\n";
        assert_eq!(meminfo_field(m, "MemAvailable"), Some(21_000_000 * 1024));
        assert_eq!(meminfo_field(m, "HugePages_Total"), Some(0));
        assert_eq!(meminfo_field(m, "Nope"), None);
        if cfg!(target_os = "linux") {
            let a = available_bytes().expect("Linux reports MemAvailable");
            assert!(a > 0);
        }
    }

    #[test]
    fn both_forms_hold_the_file_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.bin");
        // Longer than one read chunk's worth of odd sizes: not a page multiple.
        let bytes: Vec<u8> = (0..3 * 4096 + 17).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        for memory in [FileMemory::Mapped, FileMemory::Resident] {
            let b = FileBytes::open(&path, memory).unwrap();
            assert_eq!(&*b, &bytes[..], "{memory:?}");
            assert_eq!(b.memory(), memory);
        }
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        for memory in [FileMemory::Mapped, FileMemory::Resident] {
            assert!(FileBytes::open(&empty, memory).unwrap().is_empty());
        }
        let e = FileBytes::open(&dir.path().join("missing"), FileMemory::Resident)
            .err()
            .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn only_a_file_that_fits_is_made_resident() {
        assert_eq!(
            FileMemory::resident_if_it_fits(u64::MAX),
            FileMemory::Mapped
        );
        match available_bytes() {
            Some(avail) if avail >= 4 << 30 => {
                assert_eq!(
                    FileMemory::resident_if_it_fits(1 << 20),
                    FileMemory::Resident
                );
                assert_eq!(FileMemory::resident_if_it_fits(avail), FileMemory::Mapped);
            }
            Some(avail) => {
                eprintln!("only {avail} bytes available: the resident case is not checked")
            }
            None => assert_eq!(FileMemory::resident_if_it_fits(1), FileMemory::Mapped),
        }
    }
}
