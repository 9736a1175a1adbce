//! Test harness (feature `test-harness`): a real Prometheus server, Debian's `prometheus`
//! package, scraping metrics endpoints on loopback, and a small HTTP client to read values back
//! through its HTTP API. Used by this crate's tests and by the guest tests in `tests/`.
//!
//! Only the binary is used (`$PROMETHEUS_BIN`, else `/usr/bin/prometheus`), never the
//! package's systemd service: each [`Prometheus`] runs its own process with a private
//! configuration and storage directory and a free loopback port, and is killed on drop.
//! A missing binary is an error, so tests fail instead of skipping.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Where the Prometheus binary is looked for when `$PROMETHEUS_BIN` is not set.
pub const DEFAULT_BINARY: &str = "/usr/bin/prometheus";
/// The scrape job of every target (Prometheus adds it as the `job` label).
pub const JOB: &str = "vmsight";
/// How long Prometheus may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at starting Prometheus (a free port can be taken between the check and its bind).
const START_ATTEMPTS: usize = 3;
/// Pause between two looks at Prometheus while waiting for it.
const POLL: Duration = Duration::from_millis(250);
/// Bound on one HTTP exchange of the client.
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong with the harness; the messages carry Prometheus' own log where useful.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// No Prometheus binary.
    #[error(
        "prometheus binary not found at {}: install Debian's `prometheus` package \
         (scripts/setup-host.sh does) or set PROMETHEUS_BIN",
        path.display()
    )]
    BinaryMissing { path: PathBuf },
    /// A local file or process operation failed.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// Prometheus exited while starting.
    #[error("prometheus exited while starting ({status}); its log:\n{log}")]
    Exited { status: ExitStatus, log: String },
    /// Prometheus did not become ready in time.
    #[error("prometheus on {addr} not ready after {waited:?}; its log:\n{log}")]
    NotReady {
        addr: SocketAddr,
        waited: Duration,
        log: String,
    },
    /// An API answer that is not a successful JSON answer.
    #[error("GET {url}: {detail}")]
    Api { url: String, detail: String },
    /// A wait whose condition never held.
    #[error("{what} did not happen within {waited:?}; last answer: {last}")]
    Timeout {
        what: String,
        waited: Duration,
        last: String,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> HarnessError {
    let what = what.into();
    move |source| HarnessError::Io { what, source }
}

/// One element of an instant-query answer: the series' labels and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct QuerySample {
    /// Every label, including `__name__`, `job` and `instance`.
    pub labels: BTreeMap<String, String>,
    /// The value Prometheus stored.
    pub value: f64,
}

impl QuerySample {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }
}

/// A Prometheus server of its own, scraping the given targets every second.
pub struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for Prometheus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prometheus")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Prometheus {
    /// The binary used: `$PROMETHEUS_BIN`, else [`DEFAULT_BINARY`].
    pub fn binary() -> PathBuf {
        std::env::var_os("PROMETHEUS_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BINARY))
    }

    /// Starts Prometheus on a free loopback port, scraping `targets` (`host:port`, path
    /// `/metrics`) every second, and waits until it is ready.
    pub fn start(targets: &[SocketAddr]) -> Result<Prometheus, HarnessError> {
        Self::start_with(&Self::binary(), targets)
    }

    /// [`Prometheus::start`] with the given binary.
    pub fn start_with(binary: &Path, targets: &[SocketAddr]) -> Result<Prometheus, HarnessError> {
        if !binary.is_file() {
            return Err(HarnessError::BinaryMissing {
                path: binary.to_path_buf(),
            });
        }
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start_once(binary, targets) {
                Ok(p) => return Ok(p),
                // Most likely the port was taken meanwhile: try another one.
                Err(e @ HarnessError::Exited { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| HarnessError::Io {
            what: "starting prometheus".into(),
            source: io::ErrorKind::Other.into(),
        }))
    }

    fn start_once(binary: &Path, targets: &[SocketAddr]) -> Result<Prometheus, HarnessError> {
        let dir = tempfile::tempdir().map_err(io_err("creating a directory for prometheus"))?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, config_yaml(targets)).map_err(io_err("writing prometheus.yml"))?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))
            .map_err(io_err("creating prometheus.log"))?;
        let log_err = log
            .try_clone()
            .map_err(io_err("duplicating the log file"))?;
        let port = free_loopback_port().map_err(io_err("finding a free loopback port"))?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(io_err(format!("starting {}", binary.display())))?;
        let mut prometheus = Prometheus { child, addr, dir };
        prometheus.wait_ready()?;
        Ok(prometheus)
    }

    /// Waits until `/-/ready` answers 200, failing early if the process exits.
    fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let start = Instant::now();
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .map_err(io_err("waiting for prometheus"))?
            {
                return Err(HarnessError::Exited {
                    status,
                    log: self.log(),
                });
            }
            if http_get(self.addr, "/-/ready").is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(HarnessError::NotReady {
                    addr: self.addr,
                    waited: start.elapsed(),
                    log: self.log(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// The address of Prometheus' web server and API.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Prometheus' own log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/<path>?<query>` and the `data` member of a successful answer.
    pub fn api(
        &self,
        path: &str,
        params: &[(&str, &str)],
    ) -> Result<serde_json::Value, HarnessError> {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{}={}", percent_encode(k), percent_encode(v)))
            .collect();
        let target = format!("/api/v1/{path}?{}", query.join("&"));
        let url = format!("http://{}{target}", self.addr);
        let api = |detail: String| HarnessError::Api {
            url: url.clone(),
            detail,
        };
        let r = http_get(self.addr, &target).map_err(|e| api(e.to_string()))?;
        let body = String::from_utf8_lossy(&r.body);
        let json: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| api(format!("status {}, not JSON ({e}): {body}", r.status)))?;
        if r.status != 200 || json["status"] != "success" {
            return Err(api(format!("status {}: {body}", r.status)));
        }
        Ok(json["data"].clone())
    }

    /// An instant query (`/api/v1/query`): the samples of its vector result.
    pub fn query(&self, promql: &str) -> Result<Vec<QuerySample>, HarnessError> {
        let data = self.api("query", &[("query", promql)])?;
        let detail = || format!("unexpected query answer: {data}");
        let api = || HarnessError::Api {
            url: format!("query {promql}"),
            detail: detail(),
        };
        if data["resultType"] != "vector" {
            return Err(api());
        }
        data["result"]
            .as_array()
            .ok_or_else(api)?
            .iter()
            .map(|r| parse_sample(r).ok_or_else(api))
            .collect()
    }

    /// Repeats `query(promql)` until `done` accepts the answer, for at most `timeout`.
    pub fn wait_for(
        &self,
        promql: &str,
        timeout: Duration,
        mut done: impl FnMut(&[QuerySample]) -> bool,
    ) -> Result<Vec<QuerySample>, HarnessError> {
        let start = Instant::now();
        loop {
            let last = match self.query(promql) {
                Ok(samples) if done(&samples) => return Ok(samples),
                Ok(samples) => format!("{samples:?}"),
                Err(e) => e.to_string(),
            };
            if start.elapsed() > timeout {
                return Err(HarnessError::Timeout {
                    what: format!("query {promql:?} giving the expected answer"),
                    waited: start.elapsed(),
                    last: format!("{last}\nprometheus log:\n{}", self.log()),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// The targets' state (`/api/v1/targets`): one `(scrapeUrl, health, lastError)` each.
    pub fn targets(&self) -> Result<Vec<(String, String, String)>, HarnessError> {
        let data = self.api("targets", &[])?;
        let str_of = |v: &serde_json::Value, k: &str| v[k].as_str().unwrap_or_default().to_string();
        Ok(data["activeTargets"]
            .as_array()
            .map(|a| a.as_slice())
            .unwrap_or_default()
            .iter()
            .map(|t| {
                (
                    str_of(t, "scrapeUrl"),
                    str_of(t, "health"),
                    str_of(t, "lastError"),
                )
            })
            .collect())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The configuration: one job scraping every target every second.
fn config_yaml(targets: &[SocketAddr]) -> String {
    let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{}]\n",
        list.join(", ")
    )
}

/// One `{"metric": {..}, "value": [ts, "v"]}` of a vector result.
fn parse_sample(r: &serde_json::Value) -> Option<QuerySample> {
    let labels = r["metric"]
        .as_object()?
        .iter()
        .map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect::<Option<BTreeMap<_, _>>>()?;
    let value = r["value"].get(1)?.as_str()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(QuerySample { labels, value })
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_loopback_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Percent-encodes everything but unreserved characters (RFC 3986), for query strings.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// Header names (lowercase) and values, in order.
    pub headers: Vec<(String, String)>,
    /// The body as sent (the client asks HTTP/1.0, so it is never chunked).
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `GET target` over HTTP/1.0 (the server closes after the answer), bounded in time.
pub fn http_get(addr: SocketAddr, target: &str) -> io::Result<HttpResponse> {
    let request = format!("GET {target} HTTP/1.0\r\nHost: {addr}\r\nAccept: */*\r\n\r\n");
    http_exchange(addr, request.as_bytes())
}

/// Sends `request` as is and reads the answer until the server closes.
pub fn http_exchange(addr: SocketAddr, request: &[u8]) -> io::Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, HTTP_TIMEOUT)?;
    stream.set_read_timeout(Some(HTTP_TIMEOUT))?;
    stream.set_write_timeout(Some(HTTP_TIMEOUT))?;
    stream.write_all(request)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> io::Result<HttpResponse> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of the response head"))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| bad("response head not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status code"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(HttpResponse {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_strings_are_percent_encoded() {
        assert_eq!(
            percent_encode("a_b{c=\"d\"} + 1"),
            "a_b%7Bc%3D%22d%22%7D%20%2B%201"
        );
        assert_eq!(percent_encode("é"), "%C3%A9");
    }

    #[test]
    fn the_config_lists_every_target() {
        let t: Vec<SocketAddr> = vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        let yaml = config_yaml(&t);
        assert!(
            yaml.contains("targets: ['127.0.0.1:1', '127.0.0.1:2']"),
            "{yaml}"
        );
        assert!(yaml.contains("scrape_interval: 1s"), "{yaml}");
    }

    #[test]
    fn a_vector_sample_is_parsed() {
        let r =
            serde_json::json!({"metric": {"__name__": "x_total", "vm": "a"}, "value": [1.5, "42"]});
        let s = parse_sample(&r).unwrap();
        assert_eq!(s.value, 42.0);
        assert_eq!(s.label("vm"), Some("a"));
        let inf = serde_json::json!({"metric": {}, "value": [1.5, "+Inf"]});
        assert_eq!(parse_sample(&inf).unwrap().value, f64::INFINITY);
    }

    #[test]
    fn a_response_is_split_into_status_headers_and_body() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX: y\r\n\r\nbody")
            .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/plain"));
        assert_eq!(r.text(), "body");
    }
}
