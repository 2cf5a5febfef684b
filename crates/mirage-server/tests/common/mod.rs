//! What the end-to-end tests share: the SmolLM2 model path, the
//! `mirage-server` binary on an ephemeral loopback port, and a small
//! HTTP/1.1 client.
#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The SmolLM2 model, or None (with the reason printed) when model tests
/// are skipped on purpose.
pub fn model() -> Option<PathBuf> {
    let p = workspace().join("models/smollm2-135m-instruct-q4_1.gguf");
    if p.exists() {
        return Some(p);
    }
    if std::env::var("MIRAGE_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!(
            "skipping: {} is missing and MIRAGE_SKIP_MODEL_TESTS=1",
            p.display()
        );
        return None;
    }
    panic!("{} is missing: run `cargo xtask fetch-models`", p.display());
}

pub struct Server {
    pub child: Child,
    pub addr: String,
    /// The API key, sent with /metrics requests.
    pub key: Option<String>,
}

impl Server {
    pub fn start(model: &std::path::Path, extra: &[&str]) -> Server {
        Server::start_with_files(model, extra, None)
    }

    /// Starts the server; with `files`, under that open-file limit (soft
    /// and hard, so that the server cannot raise it).
    pub fn start_with_files(model: &std::path::Path, extra: &[&str], files: Option<u32>) -> Server {
        let mut cmd = match files {
            Some(n) => {
                let mut c = Command::new("sh");
                c.args([
                    "-c",
                    &format!("ulimit -n {n} && exec \"$0\" \"$@\""),
                    env!("CARGO_BIN_EXE_mirage-server"),
                ]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_mirage-server")),
        };
        let mut child = cmd
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--ctx", "1024", "--threads", "2"])
            // The references are CPU sessions: pin the backend unless the test picks one.
            .args(if extra.contains(&"--backend") {
                &[][..]
            } else {
                &["--backend", "cpu"][..]
            })
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn mirage-server");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("server printed nothing").unwrap();
        let addr = line.rsplit("http://").next().unwrap().trim().to_string();
        assert!(line.contains("listening on"), "{line}");
        let key = extra
            .iter()
            .position(|a| *a == "--api-key")
            .map(|i| extra[i + 1].to_string());
        Server { child, addr, key }
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        Response::parse(&self.raw(
            request_head(&self.addr, method, path, headers, body.len()).as_bytes(),
            body,
            Duration::from_secs(300),
        ))
    }

    /// Sends `head` then `body` on a new connection and reads until the
    /// server closes it (or the read times out, or the connection is reset
    /// after an early answer such as 413): what came back.
    pub fn raw(&self, head: &[u8], body: &[u8], timeout: Duration) -> Vec<u8> {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(timeout)).unwrap();
        s.write_all(head).unwrap();
        // A server may answer (413) before the whole body is sent.
        let _ = s.write_all(body);
        read_all(&mut s)
    }

    /// Sends a POST of `body` to `path` on a new connection and returns the
    /// connection unread (for a streaming client, one that leaves early, or
    /// one still waiting when the server stops).
    pub fn send(&self, path: &str, headers: &[(&str, &str)], body: &str) -> TcpStream {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.write_all(request_head(&self.addr, "POST", path, headers, body.len()).as_bytes())
            .unwrap();
        s.write_all(body.as_bytes()).unwrap();
        s
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    pub fn metric(&self, name: &str) -> f64 {
        let auth = self.key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let text = self.request("GET", "/metrics", &headers, b"").body;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(' '))
                    .map(|v| v.trim().parse::<f64>().unwrap())
            })
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }

    /// Polls a metric until `ok` holds, for up to `secs`.
    pub fn wait_metric(&self, name: &str, secs: u64, ok: impl Fn(f64) -> bool) -> f64 {
        let t0 = Instant::now();
        loop {
            let v = self.metric(name);
            if ok(v) || t0.elapsed() > Duration::from_secs(secs) {
                return v;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "server did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads until EOF, a timeout or a reset, keeping what arrived.
pub fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return raw,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
}

pub fn request_head(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    len: usize,
) -> String {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {len}\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn parse(raw: &[u8]) -> Response {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("no header end");
        let head = std::str::from_utf8(&raw[..split]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut body = raw[split + 4..].to_vec();
        if headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
        {
            body = dechunk(&body);
        }
        Response {
            status,
            headers,
            body: String::from_utf8(body).unwrap(),
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an event stream.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim().to_string())
            .collect()
    }

    pub fn error(&self) -> Value {
        let j = self.json();
        let e = &j["error"];
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "error without `{k}`: {j}");
        }
        e.clone()
    }
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
    out
}

/// A chat completion request for `prompt` at temperature 0.
pub fn chat_body(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
           "temperature": 0, "stream": stream})
}
