//! Checks of the device code that need no GPU.
//!
//! `nvrtc_check`: every CUDA module compiles (NVRTC, for the H100/H200's
//! sm_90: for a real architecture NVRTC also assembles the PTX, so inline
//! PTX that ptxas rejects fails here), every kernel a backend loads is in
//! its PTX with the argument count its launches pass (and the typed mat-vec
//! launches' argument kinds; the backend checks every launch's kinds at run
//! time), and every one of them waits on its prerequisite
//! grid (the programmatic-dependent-launch rule, cuda/pdl.cu). Needs only
//! `libnvrtc` (`pip install nvidia-cuda-nvrtc`, which `.ci/run` does), no
//! driver and no GPU: a kernel that would not compile on the device fails
//! here first. Without the library it prints why and passes, unless
//! `MIRAGE_REQUIRE_NVRTC=1` (set by `.ci/run`).
//!
//! `ggml_types`: the block table the kernels decode by (`GGML_TYPES` in
//! cuda/ggml.cu) is mirage-gguf's (crates/mirage-gguf/src/types.rs): ids,
//! block bytes and elements, names.
//!
//! `hostcheck`: the kernels' device functions compiled as C++ and run on the
//! CPU (`hostcheck/run.sh`: the mat-vecs' dot helpers and element
//! accessors, the RMSNorm row, the decode attention, the fused Q8_0 FFN's
//! two phases, the pruned attention, the prefill int8 tensor-core products,
//! the prefill attention on f16 tensor cores (mma fragments emulated
//! per the PTX ISA) and the activation-sparse mat-vecs against f64 references
//! or the plain forms), each emulated block's threads as fibers on one OS thread. Needs
//! g++ (C++20) and python3; without them it prints why and passes.

mod nvrtc_check {
    use crate::module;

    fn nvrtc_present() -> bool {
        // SAFETY: only probes whether the shared library can be opened.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(
                std::env::var("MIRAGE_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "MIRAGE_REQUIRE_NVRTC=1 but libnvrtc was not found (LD_LIBRARY_PATH)"
            );
            eprintln!("nvrtc_check: skipped, libnvrtc not found (pip install nvidia-cuda-nvrtc and put its lib/ on LD_LIBRARY_PATH)");
        }
        present
    }

    /// Parameters of kernel `name` in `ptx` (its `.entry` line's list).
    fn param_count(ptx: &str, name: &str) -> usize {
        let e = module::entry(ptx, name).unwrap_or_else(|| panic!("{name} not in the PTX"));
        e[..e.find(')').unwrap()].matches(".param").count()
    }

    fn check(module_name: &str, source: &str, kernels: &[String]) -> String {
        let ptx = module::compile(module_name, source, 9, 0)
            .unwrap_or_else(|e| panic!("{module_name}: {e}"));
        let missing: Vec<_> = kernels
            .iter()
            .filter(|k| module::entry(&ptx, k).is_none())
            .collect();
        assert!(
            missing.is_empty(),
            "{module_name}: kernels not in the PTX: {missing:?}"
        );
        let no_wait: Vec<_> = kernels
            .iter()
            .filter(|k| !module::waits_on_prerequisite(&ptx, k))
            .collect();
        assert!(
            no_wait.is_empty(),
            "{module_name}: kernels without griddepcontrol.wait: {no_wait:?}"
        );
        // Nothing in the PTX that no backend loads.
        let loaded: Vec<&str> = kernels.iter().map(String::as_str).collect();
        let unused: Vec<&str> = ptx
            .match_indices(".entry ")
            .map(|(i, _)| {
                let name = &ptx[i + 7..];
                &name[..name.find('(').unwrap_or(0)]
            })
            .filter(|n| !loaded.contains(n))
            .collect();
        assert!(
            unused.is_empty(),
            "{module_name}: kernels no backend loads: {unused:?}"
        );
        // Every parameter has a kind the launches can be checked against.
        for k in kernels {
            let kinds = module::param_kinds(&ptx, k).unwrap();
            assert_eq!(kinds.len(), param_count(&ptx, k), "{k}: parameter kinds");
            assert!(
                !kinds.contains(&module::ParamKind::Other),
                "{k}: a parameter of a kind no launch writes: {kinds:?}"
            );
        }
        eprintln!("{module_name}: {} kernels compile for sm_90", kernels.len());
        ptx
    }

    /// The activation-sparse module (cuda/activation_sparse.cu) compiles
    /// for sm_90 with every kernel the bench launches, and the launches the
    /// backend builds (`activation.rs`) fit its kernels' parameters kind by
    /// kind.
    #[test]
    fn activation_sparse_kernels_compile() {
        if !nvrtc_present() {
            return;
        }
        // Not `check`: the module also holds the bench's other launch
        // shapes. Every kernel the backend launches waits on its
        // prerequisite grid (launched with PDL).
        let ptx = module::compile("activation_sparse", module::ACTIVATION_SPARSE_SOURCE, 9, 0)
            .unwrap_or_else(|e| panic!("activation_sparse: {e}"));
        for k in crate::activation::kernel_names() {
            assert!(module::entry(&ptx, &k).is_some(), "{k} not in the PTX");
            assert!(
                module::waits_on_prerequisite(&ptx, &k),
                "{k}: does not wait on its prerequisite grid"
            );
        }
        assert_eq!(
            param_count(&ptx, "asp_select"),
            crate::activation::SELECT_ARGS
        );
        for variant in [
            "q8_0_serial_c8",
            "q8_0_pipelined_c8",
            "q4_k_serial_c16",
            "q4_k_pipelined_c8",
            "q4_1_serial_c16",
            "q4_1_pipelined_c8",
            "q5_0_serial_c8",
            "q5_0_pipelined_c8",
            "q6_k_serial_c8",
            "q6_k_pipelined_c4",
        ] {
            for shape in ["w4_t512", "w8_t512", "w4_t1024", "w8_t1024", "w8_t2048"] {
                let name = format!("asp_mv_{variant}_{shape}");
                assert_eq!(
                    param_count(&ptx, &name),
                    crate::activation::MATVEC_ARGS,
                    "{name}"
                );
            }
        }
        let kinds = |name: &str| module::param_kinds(&ptx, name).unwrap();
        let mut select = crate::launch::AspSelect {
            x: 1,
            cols: 256,
            thr: [2, 3, 0],
            lists: [4, 5, 0],
            norm: None,
        };
        crate::launch::check_args(&kinds("asp_select"), &select.args()).unwrap();
        select.norm = Some(crate::launch::NormFold {
            x: 6,
            w: 7,
            eps: crate::launch::F32(1e-6),
            out: 8,
        });
        crate::launch::check_args(&kinds("asp_select"), &select.args()).unwrap();
        let product = crate::launch::AspProduct {
            w: [1, 2],
            lists: [3, 4],
            y: [5, 6],
            rows: 512,
            cols: 256,
            gpw: 2,
            splits: 1,
            part: 7,
            ctr: 8,
            hthr: 9,
            hlist: 10,
            accumulate: false,
        };
        for name in crate::activation::kernel_names()
            .iter()
            .filter(|n| n.starts_with("asp_mv_"))
        {
            crate::launch::check_args(&kinds(name), &product.args())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let mask = [
            crate::launch::Arg::Ptr(1),
            crate::launch::Arg::Ptr(2),
            crate::launch::Arg::Ptr(3),
            crate::launch::Arg::I32(256),
            crate::launch::Arg::I64(512),
        ];
        crate::launch::check_args(&kinds("asp_mask"), &mask).unwrap();
    }

    #[test]
    fn dense_module_compiles_and_its_launches_fit_the_kernels() {
        if !nvrtc_present() {
            return;
        }
        let names = crate::backend::kernel_names();
        let ptx = check("dense", module::DENSE_SOURCE, &names);
        // The typed launches write these argument lists (launch.rs).
        for name in &names {
            let want = if name.starts_with("mv3_") {
                crate::matvec::MV3_ARGS
            } else if name.starts_with("ffn_") {
                crate::matvec::FFN_ARGS
            } else if name.starts_with("attend_split_mma_") {
                crate::attention::SPLIT_MMA_ARGS
            } else if name.starts_with("attend_pages_mma_") {
                crate::attention::PAGES_MMA_ARGS
            } else if name.starts_with("attend_split_rope_") {
                crate::attention::SPLIT_ROPE_ARGS
            } else if name.starts_with("attend_split_") {
                crate::attention::SPLIT_ARGS
            } else if name == "attend_combine" {
                crate::attention::COMBINE_ARGS
            } else if name.starts_with("attend_prefill_combine") {
                crate::attention::PREFILL_COMBINE_ARGS
            } else if name.starts_with("attend_prefill_") {
                crate::attention::PREFILL_ARGS
            } else if name.starts_with("mmq_") {
                crate::matvec::MMQ_ARGS
            } else if name == "quantize_q8" {
                crate::matvec::QUANTIZE_ARGS
            } else {
                continue;
            };
            // A q8_0 cache's kernels take its key and value scales last.
            let want = if name.starts_with("attend_") && name.contains("_q8_0_") {
                want + crate::attention::KV_SCALE_ARGS
            } else {
                want
            };
            assert_eq!(param_count(&ptx, name), want, "{name}");
        }
        // The split attention's blocks are as wide as its kernels' launch
        // bounds (the warp count is chosen in both places, per head size).
        for (hd, kv, form) in crate::attention::MMA_HEAD_DIMS
            .into_iter()
            .flat_map(|hd| [(hd, "f16"), (hd, "q8_0")])
            .flat_map(|(hd, kv)| ["split", "pages"].map(|form| (hd, kv, form)))
        {
            let name = format!("attend_{form}_mma_{kv}_d{hd}");
            let e = module::entry(&ptx, &name).unwrap();
            let bound = e
                .split(".maxntid")
                .nth(1)
                .and_then(|r| r.trim_start().split(',').next())
                .and_then(|n| n.trim().parse::<usize>().ok());
            assert_eq!(bound, Some(32 * crate::attention::mma_warps(hd)), "{name}");
        }
        // The typed mat-vec launches fill their kernels kind by kind (the
        // backend checks every launch the same way before it runs).
        use crate::launch::{check_args, GateUp, MatVec, Work, XSplit, F32};
        let mv = Work::MatVec(MatVec {
            w: [1; 3],
            rows: [32; 3],
            row_bytes: 64,
            cols: 256,
            x: 2,
            y: [3; 3],
            tensor_scale: [F32(1.0); 3],
            bias: [0; 3],
            res: 0,
            norm: None,
            xsplit: None,
        });
        let mvx = match &mv {
            Work::MatVec(m) => Work::MatVec(MatVec {
                xsplit: Some(XSplit { part: 5, ctr: 6 }),
                ..m.clone()
            }),
            _ => unreachable!("built above"),
        };
        let gu = Work::GateUp(GateUp {
            gate: 1,
            up: 2,
            rows: 32,
            row_bytes: 64,
            cols: 256,
            x: 3,
            h: 4,
            tensor_scale: [F32(1.0); 2],
            norm: None,
        });
        for name in &names {
            let work = if name.starts_with("mv3_") {
                &mv
            } else if name.starts_with("mvx_") {
                &mvx
            } else if name.starts_with("ffn_") {
                &gu
            } else {
                continue;
            };
            let kinds = module::param_kinds(&ptx, name).unwrap();
            check_args(&kinds, &work.args()).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn sparse_module_compiles_and_its_launches_fit_the_kernels() {
        if !nvrtc_present() {
            return;
        }
        use crate::sparse::{FFN_KERNEL_ARGS, KERNELS, Q8_FFN_ARGS, ROUTE_ARGS};
        let names: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
        let ptx = check("sparse", module::SPARSE_SOURCE, &names);
        for (name, want) in [
            ("route_bvh", ROUTE_ARGS),
            ("superblock_ffn_q8s", Q8_FFN_ARGS),
            ("superblock_ffn_nvfp4", FFN_KERNEL_ARGS + 3),
            ("superblock_ffn_q2k", FFN_KERNEL_ARGS),
        ] {
            assert_eq!(param_count(&ptx, name), want, "{name}");
        }
    }
}

mod ggml_types {
    use mirage_gguf::GgmlType;

    /// Every `X(TYPE, suffix, id, bytes, elements)` row of `GGML_TYPES`.
    fn table() -> Vec<(String, u32, usize, usize)> {
        let src = include_str!("../../../cuda/ggml.cu");
        let start = src
            .find("#define GGML_TYPES(X)")
            .expect("GGML_TYPES in ggml.cu");
        let end = start + src[start..].find("\n\n").expect("the table's end");
        src[start..end]
            .lines()
            .skip(1)
            .map(|l| {
                let row = l.trim().trim_end_matches('\\').trim();
                let f: Vec<&str> = row
                    .strip_prefix("X(")
                    .and_then(|r| r.strip_suffix(')'))
                    .unwrap_or_else(|| panic!("not a row: {l}"))
                    .split(',')
                    .map(str::trim)
                    .collect();
                let n = |i: usize| f[i].parse::<usize>().unwrap();
                (f[1].to_string(), n(2) as u32, n(3), n(4))
            })
            .collect()
    }

    #[test]
    fn the_kernels_block_table_is_mirage_gguf_s() {
        let rows = table();
        for (suffix, id, bytes, elems) in &rows {
            let ty =
                GgmlType::from_id(*id).unwrap_or_else(|| panic!("{suffix}: no ggml type {id}"));
            assert_eq!(ty.name(), suffix, "type {id}");
            assert_eq!(ty.type_size(), *bytes, "{suffix}: bytes per block");
            assert_eq!(ty.block_size(), *elems, "{suffix}: elements per block");
        }
        let ids: Vec<u32> = rows.iter().map(|r| r.1).collect();
        let rust: Vec<u32> = crate::weights::GGML_TYPES.iter().map(|t| t.id()).collect();
        assert_eq!(ids, rust, "GGML_TYPES (ggml.cu) vs weights::GGML_TYPES");
    }
}

mod hostcheck {
    fn run(script: &str) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hostcheck");
        let out = std::process::Command::new("bash")
            .arg(dir.join(script))
            .output()
            .unwrap_or_else(|e| panic!("cannot run bash {script}: {e}"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "hostcheck/{script} failed ({}):\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("hostcheck/{script}: {}", text.lines().last().unwrap_or(""));
    }

    fn tools_present() -> bool {
        let ok = |cmd: &str| {
            std::process::Command::new(cmd)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let present = ok("g++") && ok("python3");
        if !present {
            eprintln!("hostcheck: skipped, g++ or python3 not found");
        }
        present
    }

    #[test]
    fn device_code_passes_the_host_checks() {
        if tools_present() {
            run("run.sh");
        }
    }
}
