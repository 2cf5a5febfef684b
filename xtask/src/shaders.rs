//! `cargo xtask shaders [--check]`: compiles the GLSL sources in shaders/ to the
//! committed SPIR-V (`NAME.spv` beside each `NAME`) with Debian's `glslc`
//! (`apt-get install glslc`), or with `--check` fails when a committed file
//! differs from what glslc produces now (stale or hand-edited SPIR-V).
//!
//! Every stage is compiled with `--target-env=vulkan1.2 -O`, from inside
//! shaders/ with a relative path, so the output does not depend on where the
//! checkout lives. Shared `.glsl` files are includes, not stages.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// Arguments of `cargo xtask shaders`.
#[derive(Debug, clap::Args)]
pub struct ShadersArgs {
    /// Do not write: fail if any committed SPIR-V is stale or missing.
    #[arg(long)]
    pub check: bool,
}

/// Shader stages glslc compiles (by extension).
const STAGES: [&str; 7] = ["rgen", "rint", "rmiss", "rchit", "rahit", "comp", "rcall"];

fn sources(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| STAGES.contains(&e))
        {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

fn compile(dir: &Path, name: &str) -> anyhow::Result<Vec<u8>> {
    let tmp = std::env::temp_dir().join(format!("mirage-xtask-{}-{name}.spv", std::process::id()));
    let status = Command::new("glslc")
        .current_dir(dir)
        .args(["--target-env=vulkan1.2", "-O", "-o"])
        .arg(&tmp)
        .arg(name)
        .status()
        .context("running glslc (install it: apt-get install glslc)")?;
    if !status.success() {
        bail!("glslc failed on shaders/{name}");
    }
    let bytes = std::fs::read(&tmp).with_context(|| format!("reading {}", tmp.display()))?;
    let _ = std::fs::remove_file(&tmp);
    Ok(bytes)
}

/// Regenerates (or with `check`, verifies) every `shaders/*.{stage}.spv`.
pub fn run(args: &ShadersArgs, workspace_root: &Path) -> anyhow::Result<()> {
    let dir = workspace_root.join("shaders");
    let mut stale = Vec::new();
    for src in sources(&dir)? {
        let name = src
            .file_name()
            .and_then(|n| n.to_str())
            .context("non-UTF-8 shader name")?
            .to_string();
        let spv_path = dir.join(format!("{name}.spv"));
        let fresh = compile(&dir, &name)?;
        let committed = std::fs::read(&spv_path).ok();
        if committed.as_deref() == Some(fresh.as_slice()) {
            println!("up to date  shaders/{name}.spv");
        } else if args.check {
            println!("STALE       shaders/{name}.spv");
            stale.push(name);
        } else {
            std::fs::write(&spv_path, &fresh)
                .with_context(|| format!("writing {}", spv_path.display()))?;
            println!("wrote       shaders/{name}.spv");
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale SPIR-V for {}: run `cargo xtask shaders` and commit shaders/*.spv",
            stale.join(", ")
        );
    }
    Ok(())
}
