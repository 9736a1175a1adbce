//! Rendering completed syscalls: strace-style lines and JSON records.

use serde::Serialize;

use super::spec::{spec, ArgKind};
use super::tables::errno_name;
use super::tracker::{Completed, Outcome};

/// Bytes of captured strings/buffers shown in a line (strace's default is 32).
const SHOW_BYTES: usize = 32;

fn quote(bytes: &[u8], more: bool) -> String {
    let mut s = String::from("\"");
    for &b in bytes.iter().take(SHOW_BYTES.max(bytes.len().min(4096))) {
        match b {
            b'"' => s.push_str("\\\""),
            b'\\' => s.push_str("\\\\"),
            b'\n' => s.push_str("\\n"),
            b'\t' => s.push_str("\\t"),
            b'\r' => s.push_str("\\r"),
            0x20..=0x7e => s.push(b as char),
            _ => s.push_str(&format!("\\x{b:02x}")),
        }
    }
    s.push('"');
    if more {
        s.push_str("...");
    }
    s
}

fn open_flags(v: u64) -> String {
    let acc = match v & 3 {
        0 => "O_RDONLY",
        1 => "O_WRONLY",
        2 => "O_RDWR",
        _ => "O_ACCMODE",
    };
    let mut parts = vec![acc.to_string()];
    let names: [(u64, &str); 14] = [
        (0o100, "O_CREAT"),
        (0o200, "O_EXCL"),
        (0o400, "O_NOCTTY"),
        (0o1000, "O_TRUNC"),
        (0o2000, "O_APPEND"),
        (0o4000, "O_NONBLOCK"),
        (0o10000, "O_DSYNC"),
        (0o40000, "O_DIRECT"),
        (0o100000, "O_LARGEFILE"),
        (0o200000, "O_DIRECTORY"),
        (0o400000, "O_NOFOLLOW"),
        (0o1000000, "O_NOATIME"),
        (0o2000000, "O_CLOEXEC"),
        (0o20000000, "O_PATH"),
    ];
    let mut rest = v & !3;
    for (bit, n) in names {
        if rest & bit != 0 {
            parts.push(n.to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        parts.push(format!("{rest:#x}"));
    }
    parts.join("|")
}

fn signal_name(v: u64) -> String {
    const NAMES: [&str; 32] = [
        "0",
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    usize::try_from(v)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map(|s| s.to_string())
        .unwrap_or_else(|| format!("SIGRT_{}", v.saturating_sub(32)))
}

/// Decodes argument `i` of a completed call for display.
pub fn decode_arg(c: &Completed, i: usize, kind: ArgKind) -> String {
    let e = &c.entry;
    let v = e.args[i];
    match kind {
        ArgKind::Fd | ArgKind::Int => (v as i32).to_string(),
        ArgKind::DirFd => {
            if v as i32 == -100 {
                "AT_FDCWD".into()
            } else {
                (v as i32).to_string()
            }
        }
        ArgKind::Size => v.to_string(),
        ArgKind::Hex | ArgKind::OutBuf => {
            if v == 0 {
                "NULL".into()
            } else {
                format!("{v:#x}")
            }
        }
        ArgKind::Path | ArgKind::Str => match e.arg_data(i as u8) {
            Some(d) if !d.fault || !d.bytes.is_empty() => quote(&d.bytes, d.truncated),
            _ if v == 0 => "NULL".into(),
            _ => format!("{v:#x}"),
        },
        ArgKind::InBuf(len_arg) => {
            let len = e.args.get(len_arg as usize).copied().unwrap_or(0);
            match e.arg_data(i as u8) {
                Some(d) => {
                    let shown = d.bytes.len().min(SHOW_BYTES);
                    quote(&d.bytes[..shown], d.truncated || (len as usize) > shown)
                }
                None => format!("{v:#x}"),
            }
        }
        // strace's form: the offset the call started at, in brackets.
        ArgKind::OffPtr => match e
            .arg_data(i as u8)
            .and_then(|d| vmsight_proto::syscall::offset_value(&d.bytes))
        {
            _ if v == 0 => "NULL".into(),
            Some(off) => format!("[{off}]"),
            None => format!("{v:#x}"),
        },
        ArgKind::OpenFlags => open_flags(v),
        ArgKind::Mode => format!("0{:03o}", v & 0o7777),
        ArgKind::Signal => signal_name(v),
        ArgKind::Whence => match v {
            0 => "SEEK_SET".into(),
            1 => "SEEK_CUR".into(),
            2 => "SEEK_END".into(),
            3 => "SEEK_DATA".into(),
            4 => "SEEK_HOLE".into(),
            _ => v.to_string(),
        },
    }
}

/// Decoded arguments of a call.
pub fn decode_args(c: &Completed) -> Vec<String> {
    let s = spec(c.entry.nr);
    let mut n = s.args.len();
    // Like strace: open's mode is shown only when it is used (O_CREAT or O_TMPFILE).
    let flags_at = match s.name {
        "open" => Some(1),
        "openat" => Some(2),
        _ => None,
    };
    if let Some(f) = flags_at {
        if c.entry.args[f] & (0o100 | 0o20200000) == 0 {
            n -= 1;
        }
    }
    s.args[..n]
        .iter()
        .enumerate()
        .map(|(i, k)| decode_arg(c, i, *k))
        .collect()
}

/// The return value as strace shows it.
pub fn decode_ret(c: &Completed) -> String {
    match c.outcome {
        Outcome::NoReturn => "?".into(),
        Outcome::Restarted => "? ERESTART (to be restarted)".into(),
        Outcome::Returned(v) if (-4095..0).contains(&v) => {
            format!(
                "-1 {}",
                errno_name(-v)
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("E{}", -v))
            )
        }
        Outcome::Returned(v) => {
            let name = spec(c.entry.nr).name;
            if matches!(name, "mmap" | "brk" | "mremap") {
                format!("{:#x}", v as u64)
            } else {
                v.to_string()
            }
        }
    }
}

/// `pid tid name(args) = ret`, like `strace -f`.
pub fn strace_line(c: &Completed) -> String {
    let name = super::name(c.entry.nr);
    format!(
        "{} {} {}({}) = {}",
        c.entry.tgid,
        c.entry.tid,
        name,
        decode_args(c).join(", "),
        decode_ret(c)
    )
}

/// One line of `--trace-json`.
#[derive(Debug, Clone, Serialize)]
pub struct JsonRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub vcpu: u32,
    pub exit_vcpu: Option<u32>,
    pub pid: u32,
    pub tid: u32,
    pub comm: String,
    pub nr: u64,
    pub name: String,
    pub args: [u64; 6],
    pub decoded: Vec<String>,
    /// Raw kernel return value (e.g. -2 for ENOENT); null for calls that never returned.
    pub ret: Option<i64>,
    pub errno: Option<&'static str>,
    pub restarted: bool,
    pub entry_ns: u64,
    pub exit_ns: Option<u64>,
}

impl JsonRecord {
    pub fn from_completed(c: &Completed) -> JsonRecord {
        let ret = c.ret();
        JsonRecord {
            kind: "syscall",
            vcpu: c.entry.vcpu,
            exit_vcpu: c.exit_vcpu,
            pid: c.entry.tgid,
            tid: c.entry.tid,
            comm: c.entry.comm.clone(),
            nr: c.entry.nr,
            name: super::name(c.entry.nr),
            args: c.entry.args,
            decoded: decode_args(c),
            ret,
            errno: ret
                .filter(|v| (-4095..0).contains(v))
                .and_then(|v| errno_name(-v)),
            restarted: c.outcome == Outcome::Restarted,
            entry_ns: c.entry.ts_ns,
            exit_ns: c.exit_ts_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::event::{ArgData, EntryEvent};
    use super::*;

    fn completed(nr: u64, args: [u64; 6], data: Vec<ArgData>, outcome: Outcome) -> Completed {
        Completed {
            entry: EntryEvent {
                tgid: 7,
                tid: 8,
                nr,
                args,
                data,
                comm: "cat".into(),
                ..Default::default()
            },
            outcome,
            exit_ts_ns: Some(1),
            exit_vcpu: Some(0),
        }
    }

    #[test]
    fn openat_line_looks_like_strace() {
        let c = completed(
            257,
            [(-100i64) as u64, 0x1000, 0o2000000, 0, 0, 0],
            vec![ArgData {
                arg: 1,
                bytes: b"/etc/passwd".to_vec(),
                truncated: false,
                fault: false,
            }],
            Outcome::Returned(3),
        );
        assert_eq!(
            strace_line(&c),
            "7 8 openat(AT_FDCWD, \"/etc/passwd\", O_RDONLY|O_CLOEXEC) = 3"
        );
    }

    #[test]
    fn copy_file_range_shows_offsets_like_strace() {
        let c = completed(
            326,
            [3, 0x7ff0, 4, 0, 1 << 20, 0],
            vec![ArgData {
                arg: 1,
                bytes: 8192u64.to_le_bytes().to_vec(),
                truncated: false,
                fault: false,
            }],
            Outcome::Returned(4096),
        );
        assert_eq!(
            strace_line(&c),
            "7 8 copy_file_range(3, [8192], 4, NULL, 1048576, NULL) = 4096"
        );
    }

    #[test]
    fn errors_show_errno_names_and_json_keeps_raw_values() {
        let c = completed(
            2,
            [0x1000, 0, 0, 0, 0, 0],
            vec![ArgData {
                arg: 0,
                bytes: b"/nope".to_vec(),
                truncated: false,
                fault: false,
            }],
            Outcome::Returned(-2),
        );
        assert!(
            strace_line(&c).ends_with("= -1 ENOENT"),
            "{}",
            strace_line(&c)
        );
        let j = JsonRecord::from_completed(&c);
        assert_eq!(j.ret, Some(-2));
        assert_eq!(j.errno, Some("ENOENT"));
        assert_eq!(j.name, "open");
    }

    #[test]
    fn write_buffers_are_escaped_and_truncated() {
        let c = completed(
            1,
            [1, 0x1000, 100, 0, 0, 0],
            vec![ArgData {
                arg: 1,
                bytes: b"hi\n\x01".to_vec(),
                truncated: false,
                fault: false,
            }],
            Outcome::Returned(100),
        );
        assert_eq!(
            strace_line(&c),
            "7 8 write(1, \"hi\\n\\x01\"..., 100) = 100"
        );
        let x = completed(231, [0; 6], vec![], Outcome::NoReturn);
        assert_eq!(strace_line(&x), "7 8 exit_group(0) = ?");
    }
}
