//! Builds the CUTLASS kernels when feature `cutlass` is on and both nvcc and
//! the CUTLASS headers are found; otherwise sets up the stub (no probing at
//! all when the feature is off, so the default build costs nothing).
//!
//! Lookup order. nvcc: `$MIRAGE_NVCC`, `$CUDA_HOME/bin/nvcc`, `nvcc` on
//! PATH, then the PyPI wheels in python3's site-packages
//! (`nvidia/cu13/bin/nvcc` from `nvidia-cuda-nvcc` 13.x,
//! `nvidia/cuda_nvcc/bin/nvcc` from the 12.x wheels). CUTLASS:
//! `$CUTLASS_DIR/include`, then `cutlass_library/source/include` from the
//! PyPI `nvidia-cutlass` wheel (that package ships the full C++ headers,
//! cute included, plus `tools/util/include`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const SOURCES: &[(&str, &str)] = &[
    ("common.cu", "-gencode=arch=compute_90a,code=sm_90a"),
    ("sm90_bf16_gemm.cu", "-gencode=arch=compute_90a,code=sm_90a"),
    (
        "sm120_nvfp4_gemm.cu",
        "-gencode=arch=compute_120a,code=sm_120a",
    ),
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cutlass_built)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=csrc");
    for var in ["MIRAGE_NVCC", "CUDA_HOME", "CUTLASS_DIR", "MIRAGE_PYTHON"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    if env::var_os("CARGO_FEATURE_CUTLASS").is_none() {
        stub("cutlass-sys was built without feature `cutlass`");
        return;
    }
    let site = python_site_packages();
    let Some(nvcc) = find_nvcc(site.as_deref()) else {
        stub("feature `cutlass` is on but no nvcc was found (MIRAGE_NVCC, CUDA_HOME, PATH, pip nvidia-cuda-nvcc)");
        return;
    };
    let Some(cutlass) = find_cutlass(site.as_deref()) else {
        stub("feature `cutlass` is on but no CUTLASS headers were found (CUTLASS_DIR, pip nvidia-cutlass)");
        return;
    };
    build(&nvcc, &cutlass);
}

fn stub(reason: &str) {
    if env::var_os("CARGO_FEATURE_CUTLASS").is_some() {
        println!("cargo::warning=cutlass-sys: {reason}; building the NotBuilt stub");
    }
    println!("cargo::rustc-env=CUTLASS_SYS_STUB_REASON={reason}");
}

fn python_site_packages() -> Option<PathBuf> {
    let python = env::var("MIRAGE_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .ok()?;
    let path = String::from_utf8(out.stdout).ok()?;
    let path = PathBuf::from(path.trim());
    path.is_dir().then_some(path)
}

fn find_nvcc(site: Option<&Path>) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("MIRAGE_NVCC") {
        candidates.push(p.into());
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        candidates.push(Path::new(&home).join("bin/nvcc"));
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|dir| dir.join("nvcc")));
    }
    if let Some(site) = site {
        candidates.push(site.join("nvidia/cu13/bin/nvcc"));
        candidates.push(site.join("nvidia/cuda_nvcc/bin/nvcc"));
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn find_cutlass(site: Option<&Path>) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = env::var_os("CUTLASS_DIR") {
        candidates.push(Path::new(&dir).to_path_buf());
    }
    if let Some(site) = site {
        candidates.push(site.join("cutlass_library/source"));
    }
    candidates.into_iter().find(|root| {
        root.join("include/cutlass/gemm/collective/collective_builder.hpp")
            .is_file()
    })
}

/// The folder holding libcudart_static.a next to this nvcc (toolkit:
/// lib64; wheels: lib).
fn cudart_dir(nvcc: &Path) -> Option<PathBuf> {
    let top = nvcc.parent()?.parent()?;
    ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|d| top.join(d))
        .find(|d| d.join("libcudart_static.a").is_file())
}

fn build(nvcc: &Path, cutlass: &Path) {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let csrc = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it")).join("csrc");
    let started = Instant::now();
    let mut objects = Vec::new();
    // One nvcc at a time: a CUTLASS translation unit takes GBs of memory and
    // minutes of one core; CI and dev machines here have two cores.
    for (file, gencode) in SOURCES {
        let obj = out.join(format!("{file}.o"));
        let status = Command::new(nvcc)
            .args(["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr"])
            .args(["-Xcompiler", "-fPIC", gencode, "-c"])
            .arg(format!("-I{}", csrc.display()))
            .arg(format!("-I{}", cutlass.join("include").display()))
            .arg(format!(
                "-I{}",
                cutlass.join("tools/util/include").display()
            ))
            .arg(csrc.join(file))
            .arg("-o")
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on csrc/{file}");
        objects.push(obj);
    }
    let lib = out.join("libmirage_cutlass.a");
    let status = Command::new(nvcc)
        .arg("-lib")
        .arg("-o")
        .arg(&lib)
        .args(&objects)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {} -lib: {e}", nvcc.display()));
    assert!(status.success(), "nvcc -lib failed");
    println!(
        "cargo::warning=cutlass-sys: compiled {} CUDA sources with {} in {:.0} s",
        SOURCES.len(),
        nvcc.display(),
        started.elapsed().as_secs_f64()
    );
    println!("cargo::rustc-link-search=native={}", out.display());
    println!("cargo::rustc-link-lib=static=mirage_cutlass");
    let cudart = cudart_dir(nvcc).unwrap_or_else(|| {
        panic!("no libcudart_static.a next to {}", nvcc.display());
    });
    println!("cargo::rustc-link-search=native={}", cudart.display());
    println!("cargo::rustc-link-lib=static=cudart_static");
    for lib in ["stdc++", "dl", "pthread", "rt"] {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    println!("cargo::rustc-cfg=cutlass_built");
}
