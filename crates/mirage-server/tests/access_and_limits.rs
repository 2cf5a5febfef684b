//! End-to-end tests of who may use the `mirage-server` binary and how much
//! it takes (SmolLM2 on an ephemeral loopback port): the API key, the queue
//! limit and graceful shutdown, slow and half-open clients, and what a web
//! page could do to a server on localhost (Host, Origin, CORS).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

use serde_json::{json, Value};

#[test]
fn api_key_queue_limit_and_graceful_shutdown() {
    let Some(model) = model() else { return };
    let srv = Server::start(
        &model,
        &["--api-key", "sekret", "--max-batch", "1", "--queue", "1"],
    );
    let chat = chat_body("Tell me a long story about a dragon.", 300, true).to_string();
    let auth = ("Authorization", "Bearer sekret");
    let ct = ("Content-Type", "application/json");

    let r = srv.request("GET", "/v1/models", &[], b"");
    assert_eq!(r.status, 401);
    assert_eq!(r.error()["code"], "invalid_api_key");
    assert_eq!(
        srv.request(
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer wrong")],
            b""
        )
        .status,
        401
    );
    assert_eq!(srv.request("GET", "/v1/models", &[auth], b"").status, 200);
    // Health stays open for probes; metrics need the key.
    assert_eq!(srv.request("GET", "/health", &[], b"").status, 200);
    let r = srv.request("GET", "/metrics", &[], b"");
    assert_eq!(r.status, 401);
    assert_eq!(r.error()["code"], "invalid_api_key");
    assert_eq!(srv.request("GET", "/metrics", &[auth], b"").status, 200);

    // One request holds the only slot, one waits in the queue of one, the
    // third is turned away with 429 and Retry-After.
    let open = |body: &str| srv.send("/v1/chat/completions", &[auth, ct], body);
    let first = open(&chat);
    assert_eq!(
        srv.wait_metric("mirage_active_sequences", 10, |v| v == 1.0),
        1.0
    );
    let second = open(&chat);
    assert_eq!(srv.wait_metric("mirage_queue_depth", 10, |v| v == 1.0), 1.0);
    let r = srv.request("POST", "/v1/chat/completions", &[auth, ct], chat.as_bytes());
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.error()["type"], "rate_limit_error");
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry));
    assert_eq!(srv.metric("mirage_rejected_requests_total"), 1.0);

    // Both clients leave: the queued one is dropped, the slot is freed.
    drop(first);
    drop(second);
    assert_eq!(
        srv.wait_metric("mirage_active_sequences", 5, |v| v == 0.0),
        0.0
    );
    assert_eq!(srv.wait_metric("mirage_queue_depth", 5, |v| v == 0.0), 0.0);

    // SIGTERM while a request streams: it finishes, the server exits 0.
    let body = chat_body("Count to five.", 40, false).to_string();
    let mut s = open(&body);
    assert_eq!(
        srv.wait_metric("mirage_active_sequences", 10, |v| v == 1.0),
        1.0
    );
    let status = srv.terminate();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let r = Response::parse(&raw);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert!(status.success(), "server exited with {status}");
}

/// The JSON error of a raw response, checking its status.
fn raw_error(raw: &[u8], status: u16) -> Value {
    let r = Response::parse(raw);
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(raw));
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{}",
        String::from_utf8_lossy(raw)
    );
    r.error()
}

/// Slow and silent clients: hundreds of half-open connections (silent, a
/// partial head, a whole head with a partial body) against a server whose
/// open-file limit is 256 do not keep `/health` from answering at once;
/// heads and bodies that do not arrive in time are cut off (the body with a
/// JSON 408); requests hyper cannot parse get the API's JSON errors.
#[test]
fn half_open_connections_do_not_lock_out_other_clients() {
    let Some(model) = model() else { return };
    let srv = Server::start_with_files(
        &model,
        &[
            "--header-timeout",
            "2",
            "--body-timeout",
            "1",
            "--idle-timeout",
            "3",
        ],
        Some(256),
    );
    let host = srv.addr.clone();
    let head = |len: usize| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n")
    };
    let mut held = Vec::new();
    for i in 0..400 {
        let mut s = TcpStream::connect(&srv.addr).unwrap();
        match i % 3 {
            0 => {}
            1 => s
                .write_all(
                    format!("POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Slow: ").as_bytes(),
                )
                .unwrap(),
            _ => s
                .write_all(format!("{}{{\"prompt\": \"Once", head(100)).as_bytes())
                .unwrap(),
        }
        held.push(s);
    }
    for _ in 0..5 {
        let t0 = Instant::now();
        let raw = srv.raw(
            request_head(&srv.addr, "GET", "/health", &[], 0).as_bytes(),
            b"",
            Duration::from_secs(2),
        );
        let took = t0.elapsed();
        assert!(!raw.is_empty(), "/health did not answer in 2 s");
        assert_eq!(Response::parse(&raw).status, 200);
        assert!(took < Duration::from_secs(1), "/health took {took:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(srv.metric("mirage_connections_closed_total{reason=\"evicted\"}") > 0.0);

    // A body that stops coming: 408 with a JSON body after the body timeout.
    let mut slow_body = TcpStream::connect(&srv.addr).unwrap();
    slow_body
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    slow_body
        .write_all(format!("{}{{\"prompt\":", head(100)).as_bytes())
        .unwrap();
    // A head that stops coming: the connection is closed after the header timeout.
    let mut slow_head = TcpStream::connect(&srv.addr).unwrap();
    slow_head
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    slow_head.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    let t0 = Instant::now();
    let e = raw_error(&read_all(&mut slow_body), 408);
    assert_eq!(e["code"], "request_timeout");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(read_all(&mut slow_head).is_empty());
    let waited = t0.elapsed();
    assert!(
        waited > Duration::from_millis(1500) && waited < Duration::from_secs(5),
        "header timeout after {waited:?}"
    );
    assert!(srv.metric("mirage_connections_closed_total{reason=\"header_timeout\"}") > 0.0);
    drop(held);

    // What hyper cannot parse gets the API's JSON errors.
    let timeout = Duration::from_secs(5);
    let e = raw_error(&srv.raw(b"NOT HTTP AT ALL\r\n\r\n", b"", timeout), 400);
    assert_eq!(e["code"], "malformed_request");
    let bad_length = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 12abc\r\n\r\n",
        srv.addr
    );
    raw_error(&srv.raw(bad_length.as_bytes(), b"{}", timeout), 400);
    let two_lengths = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
        srv.addr
    );
    raw_error(&srv.raw(two_lengths.as_bytes(), b"{}", timeout), 400);
    let huge = format!(
        "GET /health HTTP/1.1\r\nHost: {}\r\nX-Big: {}\r\n\r\n",
        srv.addr,
        "a".repeat(40_000)
    );
    let e = raw_error(&srv.raw(huge.as_bytes(), b"", timeout), 431);
    assert_eq!(e["code"], "headers_too_large");
    let declared = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n",
        srv.addr
    );
    raw_error(&srv.raw(declared.as_bytes(), b"{}", timeout), 413);
    // A keep-alive connection: a good request, then garbage (the good
    // answer is untouched, the garbage gets the JSON 400).
    let both = format!(
        "GET /health HTTP/1.1\r\nHost: {}\r\n\r\nGET / HTTP/9\r\n\r\n",
        srv.addr
    );
    let raw = String::from_utf8(srv.raw(both.as_bytes(), b"", timeout)).unwrap();
    let second = raw.find("HTTP/1.1 400").expect(&raw);
    assert!(raw.starts_with("HTTP/1.1 200") && raw[..second].contains("\"status\":\"ok\""));
    raw_error(&raw.as_bytes()[second..], 400);
    assert!(srv.metric("mirage_protocol_errors_total") >= 5.0);
    assert_eq!(srv.request("GET", "/health", &[], b"").status, 200);
    assert!(srv.terminate().success());
}

/// What a web page could do to a server on localhost without an API key:
/// a text/plain or form POST (no preflight), a DNS-rebound `Host`, a
/// cross-origin `Origin`. Each is refused; same-origin requests (the chat
/// page), listed hosts and `--cors` origins pass.
#[test]
fn web_pages_cannot_use_the_api() {
    let Some(model) = model() else { return };
    let srv = Server::start(
        &model,
        &["--allowed-host", "my.box", "--cors", "http://app.example"],
    );
    let port = srv.addr.rsplit(':').next().unwrap().to_string();
    let body = json!({"prompt": "Hi", "max_tokens": 1, "temperature": 0}).to_string();
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let headers: Vec<(&str, &str)> = ct.iter().map(|c| ("Content-Type", *c)).collect();
        let r = srv.request("POST", "/v1/completions", &headers, body.as_bytes());
        assert_eq!(r.status, 415, "{ct:?}: {}", r.body);
        assert_eq!(r.error()["code"], "unsupported_media_type");
    }
    let r = srv.request(
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json; charset=utf-8")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Host: only the names the server answers to.
    let with_host = |host: &str, path: &str, extra: &[(&str, &str)]| {
        let mut head = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        Response::parse(&srv.raw(head.as_bytes(), b"", Duration::from_secs(30)))
    };
    for path in ["/v1/models", "/health", "/"] {
        let r = with_host(&format!("evil.example:{port}"), path, &[]);
        assert_eq!(r.status, 403, "{path}: {}", r.body);
        assert_eq!(r.error()["code"], "host_not_allowed");
        assert!(r.error()["message"]
            .as_str()
            .unwrap()
            .contains("--allowed-host evil.example"));
    }
    for host in [
        format!("localhost:{port}"),
        format!("my.box:{port}"),
        srv.addr.clone(),
    ] {
        assert_eq!(with_host(&host, "/v1/models", &[]).status, 200, "{host}");
    }

    // Origin: same-origin and listed origins only; CORS headers for listed ones.
    let r = with_host(
        &srv.addr,
        "/v1/models",
        &[("Origin", "http://evil.example")],
    );
    assert_eq!(r.status, 403);
    assert_eq!(r.error()["code"], "origin_not_allowed");
    assert!(r.header("access-control-allow-origin").is_none());
    let same = format!("http://{}", srv.addr);
    let r = with_host(&srv.addr, "/v1/models", &[("Origin", &same)]);
    assert_eq!(r.status, 200);
    let r = with_host(&srv.addr, "/v1/models", &[("Origin", "http://app.example")]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let preflight = format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nOrigin: http://app.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\nConnection: close\r\n\r\n",
        srv.addr
    );
    let r = Response::parse(&srv.raw(preflight.as_bytes(), b"", Duration::from_secs(30)));
    assert!(r.status < 300, "{} {}", r.status, r.body);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    assert!(r
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    let evil_preflight = preflight.replace("http://app.example", "http://evil.example");
    let r = Response::parse(&srv.raw(evil_preflight.as_bytes(), b"", Duration::from_secs(30)));
    assert_eq!(r.status, 403);
    assert!(r.header("access-control-allow-origin").is_none());
    assert!(srv.terminate().success());
}
