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
    /// reports as available with room to spare (a quarter of it, at least
    /// 1 GiB, stays free), else `Mapped`. Systems that report no available
    /// memory (anything but Linux) get `Mapped`.
    pub fn resident_if_it_fits(len: u64) -> FileMemory {
        match available_memory() {
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

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
        match available_memory() {
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
