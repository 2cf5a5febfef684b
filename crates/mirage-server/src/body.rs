//! The body of an API request: declared JSON (415 otherwise, so that a
//! web page cannot send one as a CORS "simple" request), at most the size
//! limit (413, from `Content-Length` before reading when it is declared),
//! and all of it within the body timeout (408).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::ApiError;
use crate::routes::AppState;

/// Limits on reading a request body.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// Largest body in bytes.
    pub max_bytes: usize,
    /// Time from the end of the head to the last byte of the body.
    pub timeout: Duration,
}

/// A JSON request body, read under [`BodyLimits`].
#[derive(Debug)]
pub struct ApiBody(pub Bytes);

/// Whether a `Content-Type` value is JSON (`application/json`, any case,
/// parameters such as `charset` allowed).
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

impl FromRequest<Arc<AppState>> for ApiBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<ApiBody, ApiError> {
        let limits = st.body_limits;
        let content_type = req.headers().get(header::CONTENT_TYPE);
        if !content_type
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json)
        {
            let got = content_type.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            return Err(ApiError::unsupported_media_type(got.as_deref()));
        }
        // hyper has checked that a Content-Length is a number (400 otherwise).
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limits.max_bytes as u64) {
            return Err(ApiError::too_large(limits.max_bytes));
        }
        let body = Limited::new(req.into_body(), limits.max_bytes);
        match tokio::time::timeout(limits.timeout, body.collect()).await {
            Err(_) => Err(ApiError::body_timeout(limits.timeout.as_secs_f64())),
            Ok(Ok(collected)) => Ok(ApiBody(collected.to_bytes())),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                Err(ApiError::too_large(limits.max_bytes))
            }
            Ok(Err(e)) => Err(ApiError::invalid(
                format!("Could not read the request body: {e}"),
                None,
            )
            .with_code("bad_body")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_json;

    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            " application/json ;charset=UTF-8",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
            "",
        ] {
            assert!(!is_json(bad), "{bad}");
        }
    }
}
