//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`
//! with the HTTP status that goes with them.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answer of the API.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `authentication_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Machine-readable code.
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429/503).
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a request that cannot be served as written.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            param: param.map(str::to_string),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Incorrect or missing API key.",
        )
        .with_code("invalid_api_key")
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown path `{path}`."),
        )
        .with_code("not_found")
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "Method not allowed.",
        )
        .with_code("method_not_allowed")
    }

    /// 413 for a body over the size limit.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("Request body is larger than {limit} bytes."),
        )
        .with_code("request_too_large")
    }

    /// 415 for a body that is not declared `application/json`.
    pub fn unsupported_media_type(got: Option<&str>) -> ApiError {
        let got = match got {
            Some(g) => format!("`{g}`"),
            None => "none".into(),
        };
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("The request body must be JSON sent with `Content-Type: application/json` (got {got})."),
        )
        .with_code("unsupported_media_type")
    }

    /// 408 when the body does not arrive in time.
    pub fn body_timeout(secs: f64) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("The request body did not arrive within {secs} seconds."),
        )
        .with_code("request_timeout")
    }

    /// 403 for a `Host` header naming a host the server does not answer to
    /// (what a DNS-rebinding page sends); `name` is its host part.
    pub fn host_not_allowed(host: &str, name: &str) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("Host `{host}` is not allowed. Start the server with `--allowed-host {name}` to answer to it."),
        )
        .with_code("host_not_allowed")
    }

    /// 403 for a cross-origin browser request from an origin not allowed
    /// with `--cors`.
    pub fn origin_not_allowed(origin: &str) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("Cross-origin requests from `{origin}` are not allowed. Start the server with `--cors {origin}` to allow them."),
        )
        .with_code("origin_not_allowed")
    }

    /// 400 for a field of the OpenAI API this server does not implement.
    pub fn unsupported_parameter(param: &str, what: &str, accepted: &str) -> ApiError {
        ApiError::invalid(
            format!("`{param}` is not supported by this server ({what}); leave it out or send {accepted}."),
            Some(param),
        )
        .with_code("unsupported_parameter")
    }

    /// 400 for a field that is not part of the API.
    pub fn unknown_parameter(param: &str) -> ApiError {
        ApiError::invalid(
            format!("Unrecognized request argument supplied: `{param}`."),
            Some(param),
        )
        .with_code("unknown_parameter")
    }

    /// The answer to a request hyper could not parse (it closes the
    /// connection after it): 400, 414 or 431 with a JSON body.
    pub fn protocol(status: StatusCode, max_header_bytes: usize) -> ApiError {
        let (message, code) = match status {
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => (
                format!("The request head is larger than {max_header_bytes} bytes or has too many header fields."),
                "headers_too_large",
            ),
            StatusCode::URI_TOO_LONG => ("The request URI is too long.".to_string(), "uri_too_long"),
            _ => (
                "Malformed HTTP request: bad request line, header or Content-Length.".to_string(),
                "malformed_request",
            ),
        };
        ApiError::new(status, "invalid_request_error", message).with_code(code)
    }

    /// 503 for a new connection when every connection slot is busy.
    pub fn too_many_connections(limit: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!(
                    "The server has {limit} connections with requests in progress. Retry later."
                ),
            )
            .with_code("too_many_connections")
        }
    }

    /// 429 when the queue is full.
    pub fn queue_full(retry_after: u64) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "The server is busy: the request queue is full. Retry later.",
            )
            .with_code("queue_full")
        }
    }

    /// 503 while shutting down.
    pub fn shutting_down() -> ApiError {
        ApiError {
            retry_after: Some(5),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "The server is shutting down.",
            )
            .with_code("shutting_down")
        }
    }

    /// 500 for a failure of the engine.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body_json(&self) -> String {
        let body = ErrorBody {
            error: ErrorFields {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        };
        serde_json::to_string(&body).unwrap_or_else(|_| "{\"error\":{}}".into())
    }
}

impl ApiError {
    /// The whole HTTP/1.1 response, for answers written straight to a
    /// connection (outside hyper); the connection closes after it.
    pub fn http_bytes(&self) -> Vec<u8> {
        let body = self.body_json();
        let mut head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or(""),
            body.len()
        );
        if let Some(s) = self.retry_after {
            head.push_str(&format!("retry-after: {s}\r\n"));
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(body.as_bytes());
        out
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            self.body_json(),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
