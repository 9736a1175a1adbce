//! Just enough HTTP/1.x for a scrape endpoint: one bounded request head in, one response out,
//! then the connection is closed. Every read and write is bounded by a deadline, so a slow or
//! silent client holds its connection for at most that long.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The parts of a request the endpoint routes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    pub method: String,
    /// The path, without its query string.
    pub path: String,
}

/// Why no request head could be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The head is larger than the limit.
    TooLarge,
    /// The request line is not `METHOD TARGET HTTP/1.x`.
    Malformed,
    /// The deadline passed before the head was complete.
    TimedOut,
    /// The client closed the connection or the socket failed: nobody to answer.
    Gone,
}

/// A response: status, content type, extra header lines and body.
#[derive(Debug)]
pub(crate) struct Response {
    pub status: u16,
    pub content_type: &'static str,
    /// Extra `Name: value` header lines.
    pub headers: Vec<(&'static str, &'static str)>,
    pub body: Vec<u8>,
}

const PLAIN: &str = "text/plain; charset=utf-8";

impl Response {
    /// A plain-text response.
    pub fn text(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: PLAIN,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// The status line, headers and blank line (`Content-Length` is the body's length even
    /// when the body itself is not sent, as for `HEAD`).
    pub fn head(&self) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.len()
        );
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        head.into_bytes()
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Reads a request head (up to the blank line) of at most `limit` bytes before `deadline`.
pub(crate) fn read_head(
    stream: &mut TcpStream,
    limit: usize,
    deadline: Instant,
) -> Result<RequestHead, ReadError> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = head_end(&buf) {
            return parse_head(&buf[..end]);
        }
        if buf.len() >= limit {
            return Err(ReadError::TooLarge);
        }
        stream
            .set_read_timeout(Some(remaining(deadline).ok_or(ReadError::TimedOut)?))
            .map_err(|_| ReadError::Gone)?;
        let want = chunk.len().min(limit - buf.len());
        match stream.read(&mut chunk[..want]) {
            Ok(0) => return Err(ReadError::Gone),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(ReadError::TimedOut),
            Err(_) => return Err(ReadError::Gone),
        }
    }
}

/// Writes all of `bytes` before `deadline`.
pub(crate) fn write_all_by(
    stream: &mut TcpStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = remaining(deadline).ok_or_else(|| io::Error::from(io::ErrorKind::TimedOut))?;
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Most a closing connection reads and throws away (see [`close_gracefully`]).
const LINGER_BYTES: usize = 64 * 1024;

/// Ends a connection after its response: sends FIN, then reads and discards what the client
/// still sends (bounded by `until` and [`LINGER_BYTES`]) until it closes too. Closing with
/// unread input makes the kernel send a reset, which can destroy the response before the
/// client has read it (an error answer to a client still sending, a request with a body).
pub(crate) fn close_gracefully(mut stream: TcpStream, until: Instant) {
    if stream.shutdown(std::net::Shutdown::Write).is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let mut total = 0;
    while total < LINGER_BYTES {
        let Some(left) = remaining(until) else {
            return;
        };
        if stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => total += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Time left until `deadline`, `None` when it has passed.
fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The length of the head including its terminating blank line (CRLF or bare LF).
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Parses the request line; header lines are not needed and not interpreted.
fn parse_head(head: &[u8]) -> Result<RequestHead, ReadError> {
    let text = std::str::from_utf8(head).map_err(|_| ReadError::Malformed)?;
    let line = text.lines().next().ok_or(ReadError::Malformed)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ReadError::Malformed);
    };
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic());
    if !token(method) || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return Err(ReadError::Malformed);
    }
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Ok(RequestHead {
        method: method.to_string(),
        path: path.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Option<RequestHead> {
        parse_head(s.as_bytes()).ok()
    }

    #[test]
    fn the_request_line_gives_method_and_path_without_query() {
        let h = parse("GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
        assert_eq!(h.method, "GET");
        assert_eq!(h.path, "/metrics");
        assert_eq!(parse("HEAD / HTTP/1.0\n\n").unwrap().path, "/");
    }

    #[test]
    fn malformed_request_lines_are_refused() {
        for bad in [
            "GET /metrics\r\n\r\n",
            "GET  /metrics HTTP/1.1\r\n\r\n",
            "GET metrics HTTP/1.1\r\n\r\n",
            "GET /metrics HTTP/2\r\n\r\n",
            "G3T /metrics HTTP/1.1\r\n\r\n",
            "GET /metrics HTTP/1.1 extra\r\n\r\n",
            "\r\n\r\n",
        ] {
            assert!(parse(bad).is_none(), "{bad:?}");
        }
        assert!(parse_head(b"GET /\xff HTTP/1.1\r\n\r\n").is_err());
    }

    #[test]
    fn the_head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    #[test]
    fn the_response_head_carries_length_and_close() {
        let mut r = Response::text(404, "nope\n");
        r.headers.push(("Allow", "GET"));
        let head = String::from_utf8(r.head()).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\n\
             Content-Length: 5\r\nConnection: close\r\nAllow: GET\r\n\r\n"
        );
    }
}
