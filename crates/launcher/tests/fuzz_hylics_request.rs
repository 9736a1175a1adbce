//! The Hylics vsock request fuzz target on stable Rust: the committed corpus, then proptest
//! over mutations and random inputs from a fresh seed (docs/fuzzing.md).
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use vmsight_launcher::fuzzing::{
    hylics_request, HY_BAD_LINE, HY_DEST_REFUSED, HY_OPENED, HY_OPEN_REFUSED, HY_OTHER,
};

const TARGET: &str = "hylics_request";
const ALL: u32 = HY_BAD_LINE | HY_OPENED | HY_OPEN_REFUSED | HY_DEST_REFUSED | HY_OTHER;

fn send(dest: &str, path: &str, offset: u64, len: u64) -> String {
    format!(
        "{{\"op\":\"send-file\",\"dest\":\"{dest}\",\"path\":\"{path}\",\"offset\":{offset},\
         \"len\":{len}}}\n"
    )
}

fn sock_send(path: &str) -> String {
    format!(
        "{{\"op\":\"sock-send\",\"path\":\"{path}\",\"tcp\":{{\"local\":\"10.0.2.15:40000\",\
         \"remote\":\"93.184.216.34:80\",\"snd_seq\":1,\"rcv_seq\":2,\"mss\":1460,\"tstamp\":true,\
         \"sack\":true,\"wscale\":true,\"snd_wscale\":7,\"rcv_wscale\":7,\"ts_val\":5,\
         \"snd_wl1\":2,\"snd_wnd\":65535,\"max_window\":65535,\"rcv_wnd\":65535,\"rcv_wup\":2}}}}\n"
    )
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let ok = [
        send("93.184.216.34:80", "file", 0, 0),
        send("10.0.2.2:8080", "/sub/file2", 1, 5),
        send("[2001:db8::1]:443", "link-in", 100, 0),
        send("10.0.2.2:8080", "link-abs", 7, 1 << 40),
    ]
    .concat();
    let escapes = [
        send("10.0.2.2:80", "../secret", 0, 0),
        send("10.0.2.2:80", "sub/../../secret", 0, 0),
        send("10.0.2.2:80", "/../../../etc/passwd", 0, 0),
        send("10.0.2.2:80", "link-out", 0, 0),
        send("10.0.2.2:80", "link-etc", 0, 0),
        send("10.0.2.2:80", "link-proc", 0, 0),
        send("10.0.2.2:80", "sub/dir", 0, 0),
        send("10.0.2.2:80", "fifo", 0, 0),
        send("10.0.2.2:80", "/", 0, 0),
        send("10.0.2.2:80", "file", 101, 0),
    ]
    .concat();
    let dests = [
        send("127.0.0.1:80", "file", 0, 0),
        send("0.0.0.0:80", "file", 0, 0),
        send("[::1]:22", "file", 0, 0),
        send("224.0.0.1:5000", "file", 0, 0),
        send("255.255.255.255:9", "file", 0, 0),
        send("10.0.2.2:0", "file", 0, 0),
        send("example.com:80", "file", 0, 0),
    ]
    .concat();
    let socket = [
        "{\"op\":\"sock-hold\",\"local\":\"10.0.2.15:40000\",\"remote\":\"93.184.216.34:80\"}\n"
            .to_string(),
        sock_send("sub/file2"),
        sock_send("../secret"),
        "{\"op\":\"sock-release\",\"local\":\"10.0.2.15:40000\",\"remote\":\"[::1]:80\"}\n"
            .to_string(),
        "{\"op\":\"arrive\"}\n{\"op\":\"task\",\"response_secs\":0.25}\n{\"op\":\"advice\"}\n"
            .to_string(),
    ]
    .concat();
    let mut long = send("10.0.2.2:80", "file", 0, 0).into_bytes();
    long.pop();
    long.pop();
    long.extend(std::iter::repeat_n(b' ', 4100));
    long.extend(b"}\n");
    let mut bad = br#"{"op":"advice"}"#.to_vec();
    bad.extend(b"\n{\"op\":\"arrive\",\"extra\":1}\n{\"op\":\"advice\"}\n");
    vec![
        ("sends-inside-the-share", ok.into_bytes()),
        ("paths-escaping-the-share", escapes.into_bytes()),
        ("destinations-not-allowed", dests.into_bytes()),
        ("socket-scheme-and-profiler", socket.into_bytes()),
        ("line-over-4096-bytes", long),
        ("unknown-field-ends-the-connection", bad),
        ("unterminated-line", br#"{"op":"advice"}"#.to_vec()),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_every_outcome() {
    let seen = driver::check_seeds(TARGET, seeds(), hylics_request);
    assert_eq!(seen, ALL, "outcomes reached by the seeds: {seen:#b}");
}

#[test]
fn corpus_and_mutations_never_open_outside_the_share() {
    driver::corpus_and_mutations(TARGET, hylics_request, ALL, ALL, 800_000, 4096);
}
