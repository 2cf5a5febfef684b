//! Who may talk to the server from a browser.
//!
//! A web page can make the browser send requests to `localhost`; three
//! checks keep such a page from using the API:
//! - `Host`: a page that rebinds its own DNS name to 127.0.0.1 (DNS
//!   rebinding) sends its own name as `Host`, so only names the server
//!   answers to pass ([`HostPolicy`]): IP literals of the bound address
//!   (any IP literal on a wildcard bind), `localhost` and `*.localhost` on a
//!   loopback or wildcard bind, and what `--allowed-host` lists. A request
//!   without `Host` passes (browsers always send one).
//! - `Origin`: a browser request from another origin passes only when
//!   `--cors` lists that origin ([`OriginPolicy`]); same-origin requests
//!   (the chat page) pass.
//! - CORS: off unless `--cors` lists origins; then [`cors_layer`] answers
//!   preflights and adds the response headers for those origins only.
//!
//! The API also takes only `application/json` bodies (see
//! [`crate::body`]), which a page cannot send without a preflight.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::error::ApiError;
use crate::routes::AppState;

/// Which `Host` names the server answers to.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    any: bool,
    bound: IpAddr,
    names: Vec<String>,
}

/// Splits `host[:port]` or `[v6]:port` into its host (without brackets).
fn host_part(authority: &str) -> &str {
    let a = authority.trim();
    if let Some(rest) = a.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match a.rsplit_once(':') {
        // One colon: host:port. More: a bare IPv6 literal.
        Some((h, port)) if !h.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => a,
    }
}

fn is_localhost_name(host: &str) -> bool {
    let h = host.trim_end_matches('.').to_ascii_lowercase();
    h == "localhost" || h.ends_with(".localhost")
}

impl HostPolicy {
    /// The policy of a server bound to `bound`, also answering to
    /// `allowed` (host names or IP literals, a port is ignored; `*`: any).
    pub fn new(bound: IpAddr, allowed: &[String]) -> HostPolicy {
        HostPolicy {
            any: allowed.iter().any(|a| a.trim() == "*"),
            bound,
            names: allowed
                .iter()
                .map(|a| host_part(a).trim_end_matches('.').to_ascii_lowercase())
                .filter(|a| !a.is_empty() && a != "*")
                .collect(),
        }
    }

    /// Whether a request with this `Host` value may be answered.
    pub fn allows(&self, host_header: &str) -> bool {
        if self.any {
            return true;
        }
        let host = host_part(host_header);
        let name = host.trim_end_matches('.').to_ascii_lowercase();
        if self.names.contains(&name) {
            return true;
        }
        let wildcard = self.bound.is_unspecified();
        let loopback = self.bound.is_loopback() || wildcard;
        if let Ok(ip) = host.parse::<IpAddr>() {
            // An IP literal cannot be rebound by DNS.
            return wildcard || ip == self.bound || (loopback && ip.is_loopback());
        }
        loopback && is_localhost_name(&name)
    }
}

/// Which browser origins may call the server.
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    any: bool,
    origins: Vec<String>,
}

impl OriginPolicy {
    /// Origins as `--cors` lists them (`scheme://host[:port]`; `*`: any).
    pub fn new(cors: &[String]) -> OriginPolicy {
        OriginPolicy {
            any: cors.iter().any(|o| o.trim() == "*"),
            origins: cors
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .filter(|o| o != "*")
                .collect(),
        }
    }

    /// Whether CORS is on.
    pub fn enabled(&self) -> bool {
        self.any || !self.origins.is_empty()
    }

    fn listed(&self, origin: &str) -> bool {
        self.any || self.origins.contains(&origin.trim().to_ascii_lowercase())
    }

    /// Whether a request with this `Origin`, sent to `host`, may be answered:
    /// same-origin (the origin's authority is the `Host`) or listed.
    pub fn allows(&self, origin: &str, host: Option<&str>) -> bool {
        if self.listed(origin) {
            return true;
        }
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        matches!((authority, host), (Some(a), Some(h)) if a.eq_ignore_ascii_case(h.trim()))
    }
}

/// The CORS layer for the listed origins (only added when CORS is on).
pub fn cors_layer(policy: &OriginPolicy, cors: &[String]) -> CorsLayer {
    let origins = if policy.any {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            cors.iter()
                .filter_map(|o| HeaderValue::from_str(o.trim().trim_end_matches('/')).ok()),
        )
    };
    CorsLayer::new()
        .allow_origin(origins)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION])
        .max_age(std::time::Duration::from_secs(600))
}

/// Middleware: the `Host` and `Origin` checks, before anything else.
pub async fn check_host_and_origin(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    if let Some(h) = &host {
        if !st.hosts.allows(h) {
            return ApiError::host_not_allowed(h, host_part(h)).into_response();
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = String::from_utf8_lossy(origin.as_bytes());
        if !st.origins.allows(&origin, host.as_deref()) {
            return ApiError::origin_not_allowed(&origin).into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_bind_answers_to_loopback_names_only() {
        let p = HostPolicy::new(ip("127.0.0.1"), &[]);
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "app.localhost:1",
            "[::1]:8080",
            "127.0.0.2:80",
        ] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "localhost.evil.example",
            "10.0.0.1:8080",
            "example.com",
            "",
        ] {
            assert!(!p.allows(bad), "{bad}");
        }
        let p = HostPolicy::new(ip("127.0.0.1"), &["my.box:9000".into()]);
        assert!(p.allows("my.box:8080") && p.allows("MY.BOX") && !p.allows("other.box"));
    }

    #[test]
    fn specific_and_wildcard_binds() {
        let p = HostPolicy::new(ip("192.168.1.5"), &[]);
        assert!(p.allows("192.168.1.5:8080"));
        assert!(!p.allows("localhost:8080") && !p.allows("192.168.1.6") && !p.allows("box.lan"));
        let p = HostPolicy::new(ip("0.0.0.0"), &["box.lan".into()]);
        assert!(p.allows("192.168.1.5:8080") && p.allows("[fe80::1]:80") && p.allows("localhost"));
        assert!(p.allows("box.lan:8080") && !p.allows("evil.example"));
        assert!(HostPolicy::new(ip("0.0.0.0"), &["*".into()]).allows("anything.example"));
    }

    #[test]
    fn origins() {
        let p = OriginPolicy::new(&[]);
        assert!(!p.enabled());
        assert!(p.allows("http://127.0.0.1:8080", Some("127.0.0.1:8080")));
        assert!(!p.allows("http://evil.example", Some("127.0.0.1:8080")));
        assert!(!p.allows("null", Some("127.0.0.1:8080")));
        assert!(!p.allows("http://127.0.0.1:9999", Some("127.0.0.1:8080")));
        let p = OriginPolicy::new(&["https://app.example/".into()]);
        assert!(p.enabled() && p.allows("https://app.example", Some("127.0.0.1:8080")));
        assert!(!p.allows("https://other.example", Some("127.0.0.1:8080")));
        assert!(OriginPolicy::new(&["*".into()]).allows("null", None));
    }
}
