//! Comparing vmsight's syscall trace with strace's, per thread.
//!
//! Threads are keyed by their place in the process tree, not by TID (TIDs differ between two
//! runs): the first traced thread is `0`, and the i-th thread or process created by thread `K`
//! (through clone/clone3/fork/vfork) is `K.i`. Each thread's sequence is a list of
//! `(name, fd-or-path arguments, return)`; restarted and unfinished calls show `?`.

use std::collections::HashMap;

/// One syscall, reduced to what both tools must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// The compared arguments ([`compared`]), in order: fds, flags, modes, counts and offsets
    /// as numbers, paths as strings, `*` where the runs may differ.
    pub key_args: Vec<String>,
    /// The return value as a number, an errno name (`-ENOENT`), or `?`.
    pub ret: String,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}({}) = {}",
            self.name,
            self.key_args.join(", "),
            self.ret
        )
    }
}

/// Per-thread sequences keyed by tree position.
pub type Threads = HashMap<String, Vec<Call>>;

/// Whether the two traces observed the very same execution (strace and vmsight at once), so
/// PIDs and addresses must agree too, or separate runs, where they are masked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    Same,
    Separate,
}

const CREATORS: [&str; 4] = ["clone", "clone3", "fork", "vfork"];

/// How one compared argument is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An `int` (fds, flags, commands, modes): compared as 32 bits, signed.
    Int,
    /// A 64-bit count or offset.
    Long,
    /// A path.
    Path,
    /// A PID argument: masked across separate runs.
    Pid,
    /// An address: masked across separate runs (ASLR).
    Addr,
}

/// `fcntl` commands whose third argument is a number (strace prints it, and so do we).
const FCNTL_NUMERIC_ARG: [i128; 9] = [0, 1030, 2, 4, 8, 10, 1024, 1026, 1031];
/// Whether `open`/`openat` flags take a mode: with `O_CREAT`, or `O_TMPFILE` (which
/// includes `O_DIRECTORY`'s bit).
fn takes_mode(flags: i128) -> bool {
    const O_CREAT: i128 = 0o100;
    const O_TMPFILE: i128 = 0o20200000;
    flags & O_CREAT != 0 || flags & O_TMPFILE == O_TMPFILE
}

/// The compared arguments of syscall `name`: (strace's argument index, the raw register
/// index, kind). They differ where strace folds two registers into one (the offset of
/// `preadv2`/`pwritev2`). `num(i)` gives strace-side argument i as a number, for arguments
/// shown only sometimes (the mode of `openat`, the third of `fcntl`).
fn compared(name: &str, num: impl Fn(usize) -> Option<i128>) -> Vec<(usize, usize, Kind)> {
    use Kind::*;
    let same = |v: &[(usize, Kind)]| v.iter().map(|&(i, k)| (i, i, k)).collect::<Vec<_>>();
    match name {
        "read" | "write" | "getdents64" => same(&[(0, Int), (2, Long)]),
        "pread64" | "pwrite64" => same(&[(0, Int), (2, Long), (3, Long)]),
        "readv" | "writev" => same(&[(0, Int), (2, Int)]),
        "preadv" | "pwritev" => same(&[(0, Int), (2, Int), (3, Long)]),
        "preadv2" | "pwritev2" => vec![(0, 0, Int), (2, 2, Int), (3, 3, Long), (4, 5, Int)],
        "close" | "fstat" | "dup" | "fsync" | "fdatasync" | "fchdir" | "accept" | "getsockname"
        | "getpeername" => same(&[(0, Int)]),
        "ftruncate" | "lseek" => same(&[(0, Int), (1, Long), (2, Int)]),
        "fchmod" | "dup2" | "listen" | "shutdown" | "ioctl" => same(&[(0, Int), (1, Int)]),
        "dup3" | "socket" | "socketpair" => same(&[(0, Int), (1, Int), (2, Int)]),
        "fchown" => same(&[(0, Int), (1, Int), (2, Int)]),
        "mmap" => same(&[
            (0, Addr),
            (1, Long),
            (2, Int),
            (3, Int),
            (4, Int),
            (5, Long),
        ]),
        "fcntl" if num(1).is_some_and(|c| FCNTL_NUMERIC_ARG.contains(&c)) => {
            same(&[(0, Int), (1, Int), (2, Int)])
        }
        "fcntl" => same(&[(0, Int), (1, Int)]),
        "openat" if num(2).is_some_and(takes_mode) => {
            same(&[(0, Int), (1, Path), (2, Int), (3, Int)])
        }
        "openat" => same(&[(0, Int), (1, Path), (2, Int)]),
        "open" if num(1).is_some_and(takes_mode) => same(&[(0, Path), (1, Int), (2, Int)]),
        "open" => same(&[(0, Path), (1, Int)]),
        "newfstatat" => same(&[(0, Int), (1, Path), (3, Int)]),
        "statx" | "fchmodat" | "faccessat2" => same(&[(0, Int), (1, Path), (2, Int)]),
        "faccessat" | "readlinkat" | "utimensat" | "fchownat" => same(&[(0, Int), (1, Path)]),
        "unlinkat" | "mkdirat" => same(&[(0, Int), (1, Path), (2, Int)]),
        "creat" | "mkdir" | "chmod" => same(&[(0, Path), (1, Int)]),
        "truncate" => same(&[(0, Path), (1, Long)]),
        "stat" | "lstat" | "access" | "chdir" | "unlink" | "rmdir" | "execve" | "readlink" => {
            same(&[(0, Path)])
        }
        "rename" | "link" | "symlink" => same(&[(0, Path), (1, Path)]),
        "renameat" | "renameat2" | "linkat" => same(&[(0, Int), (1, Path), (2, Int), (3, Path)]),
        "bind" | "connect" => same(&[(0, Int), (2, Int)]),
        "accept4" => same(&[(0, Int), (3, Int)]),
        "sendto" | "recvfrom" => same(&[(0, Int), (2, Long), (3, Int)]),
        "sendmsg" | "recvmsg" => same(&[(0, Int), (2, Int)]),
        "setsockopt" => same(&[(0, Int), (1, Int), (2, Int), (4, Int)]),
        "getsockopt" => same(&[(0, Int), (1, Int), (2, Int)]),
        "sendfile" => same(&[(0, Int), (1, Int), (3, Long)]),
        "splice" | "copy_file_range" => same(&[(0, Int), (2, Int), (4, Long), (5, Int)]),
        "pipe2" => same(&[(1, Int)]),
        "wait4" => same(&[(0, Pid), (2, Int)]),
        "kill" => same(&[(0, Pid), (1, Int)]),
        "exit" | "exit_group" => same(&[(0, Int)]),
        _ => Vec::new(),
    }
}

/// A number as strace prints it with `-X raw`: decimal (maybe negative), `0x` hex, `0` octal
/// (modes), `NULL`, or such numbers joined by `|` (flags it splits, e.g. a socket type).
fn strace_number(a: &str) -> Option<i128> {
    let a = a.trim();
    if a.contains('|') {
        return a
            .split('|')
            .try_fold(0i128, |acc, p| Some(acc | strace_number(p)?));
    }
    if a == "NULL" {
        return Some(0);
    }
    let (neg, t) = match a.strip_prefix('-') {
        Some(t) => (true, t),
        None => (false, a),
    };
    let v = if let Some(h) = t.strip_prefix("0x") {
        i128::from_str_radix(h, 16).ok()?
    } else if t.len() > 1 && t.starts_with('0') {
        i128::from_str_radix(t, 8).ok()?
    } else {
        t.parse::<i128>().ok()?
    };
    Some(if neg { -v } else { v })
}

/// One argument shown by `kind`: numbers as 32-bit signed (`Int`) or 64-bit unsigned
/// (`Long`) values, whatever width they were printed or passed in; `*` when masked.
fn show(kind: Kind, runs: Runs, num: Option<i128>, text: Option<String>) -> String {
    let n = |f: fn(i128) -> String| num.map(f).unwrap_or_else(|| "?".into());
    match kind {
        Kind::Pid | Kind::Addr if runs == Runs::Separate => "*".into(),
        Kind::Int | Kind::Pid => n(|v| (v as i64 as i32).to_string()),
        Kind::Long | Kind::Addr => n(|v| (v as i64 as u64).to_string()),
        Kind::Path => text.unwrap_or_else(|| "?".into()),
    }
}

/// The return value, masked across separate runs where it is a PID or an address.
fn reduce_ret(name: &str, ret: String, runs: Runs) -> String {
    let pid = CREATORS.contains(&name)
        || matches!(name, "wait4" | "waitid" | "getpid" | "getppid" | "gettid");
    let addr = matches!(name, "mmap" | "brk" | "mremap");
    if runs == Runs::Separate && (pid || addr) && ret.parse::<i64>().is_ok_and(|v| v > 0) {
        return if pid { "<pid>" } else { "<addr>" }.to_string();
    }
    ret
}

/// strace's side of a call: its argument texts.
fn reduce_strace(name: &str, args: &[String], ret: String, runs: Runs) -> Call {
    let num = |i: usize| args.get(i).and_then(|a| strace_number(a));
    let key_args = compared(name, num)
        .into_iter()
        .map(|(si, _, k)| show(k, runs, num(si), args.get(si).map(|a| unquote(a))))
        .collect();
    Call {
        name: name.to_string(),
        key_args,
        ret: reduce_ret(name, ret, runs),
    }
}

/// vmsight's side of a call: the raw registers, and the decoded text for paths.
fn reduce_vmsight(name: &str, raw: &[u64], decoded: &[String], ret: String, runs: Runs) -> Call {
    let num = |i: usize| raw.get(i).map(|&v| i128::from(v));
    // The strace-side index decides conditional arguments; both are the same for those.
    let key_args = compared(name, num)
        .into_iter()
        .map(|(_, ri, k)| show(k, runs, num(ri), decoded.get(ri).map(|a| unquote(a))))
        .collect();
    Call {
        name: name.to_string(),
        key_args,
        ret: reduce_ret(name, ret, runs),
    }
}

/// Splits strace's argument text at top-level commas.
fn split_args(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut depth, mut in_str, mut esc) = (0i32, false, false);
    for ch in s.chars() {
        if in_str {
            cur.push(ch);
            if esc {
                esc = false;
            } else if ch == '\\' {
                esc = true;
            } else if ch == '"' {
                in_str = false;
            }
            continue;
        }
        match ch {
            '"' => {
                in_str = true;
                cur.push(ch);
            }
            '(' | '[' | '{' => {
                depth += 1;
                cur.push(ch);
            }
            ')' | ']' | '}' => {
                depth -= 1;
                cur.push(ch);
            }
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
            }
            _ => cur.push(ch),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// strace shows a path as `"..."` (with `...` after it when truncated): keep the inside.
fn unquote(a: &str) -> String {
    let a = a.trim_end_matches("...");
    a.strip_prefix('"')
        .and_then(|x| x.strip_suffix('"'))
        .unwrap_or(a)
        .to_string()
}

/// Parses `strace -f -o FILE` output (lines `PID name(args) = ret`, with `<unfinished ...>` and
/// `<... name resumed>` pairs) into per-thread sequences. strace must print constants as
/// numbers (`-X raw`).
pub fn parse_strace(text: &str, runs: Runs) -> Threads {
    // Join unfinished/resumed halves per pid.
    let mut partial: HashMap<String, String> = HashMap::new();
    let mut lines: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let Some((pid, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        if rest.starts_with("---") || rest.starts_with("+++") {
            continue;
        }
        if let Some(head) = rest.strip_suffix("<unfinished ...>") {
            partial.insert(pid.to_string(), head.trim_end().to_string());
            continue;
        }
        if rest.starts_with("<...") {
            let Some(pos) = rest.find("resumed>") else {
                continue;
            };
            let tail = &rest[pos + "resumed>".len()..];
            let head = partial.remove(pid).unwrap_or_default();
            let joined = if head.ends_with('(') || head.ends_with(", ") || head.is_empty() {
                format!("{head}{tail}")
            } else if head.ends_with(',') {
                format!("{head} {tail}")
            } else {
                format!("{head}, {tail}")
            };
            lines.push((pid.to_string(), joined));
            continue;
        }
        lines.push((pid.to_string(), rest.to_string()));
    }
    let mut calls: Vec<(String, String, Vec<String>, String)> = Vec::new();
    for (pid, l) in lines {
        let Some(open) = l.find('(') else { continue };
        let name = l[..open].trim().to_string();
        // `name(args) = ret`; strace pads short lines with spaces before ` = `.
        let Some(eq) = l.rfind(" = ") else { continue };
        let Some(close) = l[..eq].rfind(')') else {
            continue;
        };
        if close < open {
            continue;
        }
        let args = split_args(&l[open + 1..close]);
        let ret_text = l[eq + 3..].trim();
        let ret = normalize_strace_ret(ret_text);
        calls.push((pid, name, args, ret));
    }
    build_tree(calls.into_iter().map(|(pid, name, args, ret)| {
        let created = if CREATORS.contains(&name.as_str()) {
            ret.parse::<i64>()
                .ok()
                .filter(|v| *v > 0)
                .map(|v| v.to_string())
        } else {
            None
        };
        (pid, reduce_strace(&name, &args, ret, runs), created)
    }))
}

fn normalize_strace_ret(t: &str) -> String {
    let first = t.split_whitespace().next().unwrap_or("?");
    if first == "?" {
        return "?".into();
    }
    if first == "-1" {
        if let Some(e) = t.split_whitespace().nth(1) {
            return format!("-{e}");
        }
    }
    if let Some(h) = first.strip_prefix("0x") {
        if let Ok(v) = i64::from_str_radix(h, 16) {
            return v.to_string();
        }
    }
    first.to_string()
}

/// Parses vmsight's `--trace-json` lines.
pub fn parse_vmsight_json(text: &str, runs: Runs) -> Threads {
    let mut calls = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["type"] != "syscall" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or("?").to_string();
        let raw: Vec<u64> = v["args"]
            .as_array()
            .map(|a| a.iter().map(|x| x.as_u64().unwrap_or(0)).collect())
            .unwrap_or_default();
        let decoded: Vec<String> = v["decoded"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default();
        let ret = match (v["ret"].as_i64(), v["errno"].as_str()) {
            (Some(_), Some(e)) => format!("-{e}"),
            (Some(r), None) => r.to_string(),
            (None, _) => "?".to_string(),
        };
        let created = if CREATORS.contains(&name.as_str()) {
            v["ret"].as_i64().filter(|r| *r > 0).map(|r| r.to_string())
        } else {
            None
        };
        let tid = v["tid"].as_u64().unwrap_or(0).to_string();
        calls.push((
            tid,
            reduce_vmsight(&name, &raw, &decoded, ret, runs),
            created,
        ));
    }
    build_tree(calls.into_iter())
}

/// Keys threads by tree position (see the module docs). Calls must be in completion order per
/// thread, and a creator's return must come before the child's first call in the input, which
/// holds for both tools since the child's first traced call happens after the fork returned a
/// value to... not necessarily: so children seen before their creator's return are resolved
/// at the end.
fn build_tree(calls: impl Iterator<Item = (String, Call, Option<String>)>) -> Threads {
    let mut per_tid: Vec<(String, Vec<Call>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut children: HashMap<String, Vec<String>> = HashMap::new();
    for (tid, call, created) in calls {
        let i = *index.entry(tid.clone()).or_insert_with(|| {
            per_tid.push((tid.clone(), Vec::new()));
            per_tid.len() - 1
        });
        per_tid[i].1.push(call);
        if let Some(c) = created {
            children.entry(tid.clone()).or_default().push(c);
        }
    }
    let mut out = Threads::new();
    let Some((root, _)) = per_tid.first().cloned() else {
        return out;
    };
    let seqs: HashMap<String, Vec<Call>> = per_tid.into_iter().collect();
    let mut stack = vec![(root, "0".to_string())];
    let mut seen = std::collections::HashSet::new();
    while let Some((tid, key)) = stack.pop() {
        if !seen.insert(tid.clone()) {
            continue;
        }
        if let Some(kids) = children.get(&tid) {
            for (i, k) in kids.iter().enumerate() {
                stack.push((k.clone(), format!("{key}.{i}")));
            }
        }
        out.insert(key, seqs.get(&tid).cloned().unwrap_or_default());
    }
    out
}

/// Differences between two traces, as readable lines (empty when they agree).
pub fn diff(expected: &Threads, got: &Threads) -> Vec<String> {
    let mut out = Vec::new();
    let mut keys: Vec<&String> = expected.keys().chain(got.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let e = expected.get(k).map(Vec::as_slice).unwrap_or(&[]);
        let g = got.get(k).map(Vec::as_slice).unwrap_or(&[]);
        if e == g {
            continue;
        }
        let at = e
            .iter()
            .zip(g)
            .position(|(a, b)| a != b)
            .unwrap_or(e.len().min(g.len()));
        out.push(format!(
            "thread {k}: {} calls in strace, {} in vmsight; first difference at #{at}: strace {} / vmsight {}",
            e.len(),
            g.len(),
            e.get(at).map(|c| c.to_string()).unwrap_or_else(|| "<end>".into()),
            g.get(at).map(|c| c.to_string()).unwrap_or_else(|| "<end>".into()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strace_lines_are_parsed_with_resumed_halves_and_children() {
        let text = "\
100 openat(-100, \"/etc/passwd\", 0x80000) = 3
100 read(3, \"root:x\"..., 4096) = 1200
100 clone(child_stack=NULL, flags=0x1200011, child_tidptr=0x7f) = 101
101 read(0,  <unfinished ...>
100 wait4(-1,  <unfinished ...>
101 <... read resumed>\"x\", 10) = 1
101 exit_group(0)                     = ?
100 <... wait4 resumed>NULL, 0, NULL) = 101
100 --- SIGCHLD {si_signo=SIGCHLD} ---
100 openat(-100, \"/nope\", 0x241, 0640) = -1 ENOENT (No such file or directory)
100 fcntl(3, 0x3)                     = 0x8002 (flags O_RDWR|O_LARGEFILE)
100 socket(0x1, 0x1|0x80000, 0) = 4
100 openat(-100, \"/\", 0x210000) = 5
100 pwritev2(3, [{iov_base=\"dd\"..., iov_len=4096}], 1, -1, 0x10) = 300
100 +++ exited with 0 +++
";
        let t = parse_strace(text, Runs::Same);
        let main = &t["0"];
        assert_eq!(main[0].to_string(), "openat(-100, /etc/passwd, 524288) = 3");
        assert_eq!(main[1].to_string(), "read(3, 4096) = 1200");
        assert_eq!(main[2].to_string(), "clone() = 101");
        assert_eq!(main[3].to_string(), "wait4(-1, 0) = 101");
        assert_eq!(
            main[4].to_string(),
            "openat(-100, /nope, 577, 416) = -ENOENT"
        );
        assert_eq!(main[5].to_string(), "fcntl(3, 3) = 32770");
        assert_eq!(main[6].to_string(), "socket(1, 524289, 0) = 4");
        assert_eq!(main[7].to_string(), "openat(-100, /, 2162688) = 5");
        assert_eq!(
            main[8].to_string(),
            "pwritev2(3, 1, 18446744073709551615, 16) = 300"
        );
        assert_eq!(t["0.0"][0].to_string(), "read(0, 10) = 1");
        assert_eq!(t["0.0"][1].to_string(), "exit_group(0) = ?");
        // Separate runs: PIDs and addresses are masked.
        let t = parse_strace(text, Runs::Separate);
        assert_eq!(t["0"][2].to_string(), "clone() = <pid>");
        assert_eq!(t["0"][3].to_string(), "wait4(*, 0) = <pid>");
    }

    #[test]
    fn vmsight_json_is_parsed_into_the_same_shape() {
        let text = r#"{"type":"syscall","tid":7,"name":"openat","args":[18446744073709551516,1,524288,0,0,0],"decoded":["AT_FDCWD","\"/etc/passwd\"","O_RDONLY|O_CLOEXEC"],"ret":3,"errno":null}
{"type":"syscall","tid":7,"name":"openat","args":[4294967196,1,577,416,0,0],"decoded":["AT_FDCWD","\"/nope\"","O_WRONLY|O_CREAT|O_TRUNC","0640"],"ret":-2,"errno":"ENOENT"}
{"type":"syscall","tid":7,"name":"mmap","args":[0,8192,3,34,4294967295,0],"decoded":[],"ret":140110425587712,"errno":null}
{"type":"syscall","tid":7,"name":"pwritev2","args":[3,1,1,18446744073709551615,0,16],"decoded":[],"ret":300,"errno":null}
{"type":"syscall","tid":7,"name":"clone","args":[18874385,0,0,0,0,0],"decoded":[],"ret":9,"errno":null}
{"type":"syscall","tid":9,"name":"exit_group","args":[0,0,0,0,0,0],"decoded":["0"],"ret":null,"errno":null}"#;
        let t = parse_vmsight_json(text, Runs::Same);
        assert_eq!(
            t["0"][0].to_string(),
            "openat(-100, /etc/passwd, 524288) = 3"
        );
        assert_eq!(
            t["0"][1].to_string(),
            "openat(-100, /nope, 577, 416) = -ENOENT"
        );
        assert_eq!(
            t["0"][2].to_string(),
            "mmap(0, 8192, 3, 34, -1, 0) = 140110425587712"
        );
        assert_eq!(t["0.0"][0].to_string(), "exit_group(0) = ?");
        let s = parse_strace(
            "5 openat(-100, \"/etc/passwd\", 0x80000) = 3\n\
             5 openat(-100, \"/nope\", 0x241, 0640) = -1 ENOENT (x)\n\
             5 mmap(NULL, 8192, 0x3, 0x22, -1, 0) = 0x7f6e00258000\n\
             5 pwritev2(3, [{iov_base=\"dd\"..., iov_len=4096}], 1, -1, 0x10) = 300\n\
             5 clone(x) = 9\n9 exit_group(0) = ?\n",
            Runs::Same,
        );
        assert!(diff(&s, &t).is_empty(), "{:?}", diff(&s, &t));
        // A different mode or count is a difference.
        let bad = parse_strace("5 openat(-100, \"/etc/passwd\", 0x80001) = 3\n", Runs::Same);
        assert!(!diff(
            &bad,
            &parse_vmsight_json(text.lines().next().unwrap(), Runs::Same)
        )
        .is_empty());
    }
}
