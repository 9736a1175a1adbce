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
    /// Fd arguments (as numbers) and path arguments (as strings), in argument order.
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

const CREATORS: [&str; 4] = ["clone", "clone3", "fork", "vfork"];

/// Which arguments are fds and which are paths, by syscall name (the ones the tests filter).
fn key_arg_positions(name: &str) -> (&'static [usize], &'static [usize]) {
    // (fd positions, path positions)
    match name {
        "read" | "write" | "close" | "pread64" | "pwrite64" | "lseek" | "fstat" | "dup"
        | "fsync" | "getdents64" | "ftruncate" | "fchdir" | "fchmod" | "fchown" | "fdatasync" => {
            (&[0], &[])
        }
        "dup2" | "dup3" => (&[0, 1], &[]),
        "openat" | "newfstatat" | "faccessat" | "faccessat2" | "unlinkat" | "mkdirat"
        | "fchmodat" | "readlinkat" | "statx" | "utimensat" | "fchownat" => (&[], &[1]),
        "open" | "creat" | "stat" | "lstat" | "access" | "chdir" | "unlink" | "rmdir" | "mkdir"
        | "execve" | "truncate" | "chmod" | "readlink" => (&[], &[0]),
        "rename" | "link" | "symlink" => (&[], &[0, 1]),
        "renameat" | "renameat2" | "linkat" => (&[], &[1, 3]),
        _ => (&[], &[]),
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

fn reduce(name: &str, args: &[String], ret: String) -> Call {
    // PIDs differ between runs: a positive return that is a PID compares as `<pid>`.
    let ret = if (CREATORS.contains(&name)
        || matches!(name, "wait4" | "waitid" | "getpid" | "getppid" | "gettid"))
        && ret.parse::<i64>().is_ok_and(|v| v > 0)
    {
        "<pid>".to_string()
    } else {
        ret
    };
    let (fds, paths) = key_arg_positions(name);
    let mut key_args = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if fds.contains(&i) {
            key_args.push(a.clone());
        } else if paths.contains(&i) {
            key_args.push(unquote(a));
        }
    }
    Call {
        name: name.to_string(),
        key_args,
        ret,
    }
}

/// Parses `strace -f -o FILE` output (lines `PID name(args) = ret`, with `<unfinished ...>` and
/// `<... name resumed>` pairs) into per-thread sequences.
pub fn parse_strace(text: &str) -> Threads {
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
        (pid, reduce(&name, &args, ret), created)
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
pub fn parse_vmsight_json(text: &str) -> Threads {
    let mut calls = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["type"] != "syscall" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or("?").to_string();
        let args: Vec<String> = v["decoded"]
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
        calls.push((tid, reduce(&name, &args, ret), created));
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
100 openat(AT_FDCWD, \"/etc/passwd\", O_RDONLY) = 3
100 read(3, \"root:x\"..., 4096) = 1200
100 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|SIGCHLD, child_tidptr=0x7f) = 101
101 read(0,  <unfinished ...>
100 wait4(-1,  <unfinished ...>
101 <... read resumed>\"x\", 10) = 1
101 exit_group(0)                     = ?
100 <... wait4 resumed>NULL, 0, NULL) = 101
100 --- SIGCHLD {si_signo=SIGCHLD} ---
100 openat(AT_FDCWD, \"/nope\", O_RDONLY) = -1 ENOENT (No such file or directory)
100 +++ exited with 0 +++
";
        let t = parse_strace(text);
        let main = &t["0"];
        assert_eq!(main[0].to_string(), "openat(/etc/passwd) = 3");
        assert_eq!(main[1].to_string(), "read(3) = 1200");
        assert_eq!(main[4].to_string(), "openat(/nope) = -ENOENT");
        assert_eq!(t["0.0"][0].to_string(), "read(0) = 1");
        assert_eq!(t["0.0"][1].to_string(), "exit_group() = ?");
    }

    #[test]
    fn vmsight_json_is_parsed_into_the_same_shape() {
        let text = r#"{"type":"syscall","tid":7,"name":"openat","decoded":["AT_FDCWD","\"/etc/passwd\"","O_RDONLY"],"ret":3,"errno":null}
{"type":"syscall","tid":7,"name":"openat","decoded":["AT_FDCWD","\"/nope\"","O_RDONLY"],"ret":-2,"errno":"ENOENT"}
{"type":"syscall","tid":7,"name":"clone","decoded":[],"ret":9,"errno":null}
{"type":"syscall","tid":9,"name":"exit_group","decoded":["0"],"ret":null,"errno":null}"#;
        let t = parse_vmsight_json(text);
        assert_eq!(t["0"][0].to_string(), "openat(/etc/passwd) = 3");
        assert_eq!(t["0"][1].to_string(), "openat(/nope) = -ENOENT");
        assert_eq!(t["0.0"][0].to_string(), "exit_group() = ?");
        let s = parse_strace("5 openat(AT_FDCWD, \"/etc/passwd\", O_RDONLY) = 3\n5 openat(AT_FDCWD, \"/nope\", O_RDONLY) = -1 ENOENT (x)\n5 clone(x) = 6\n6 exit_group(0) = ?\n");
        assert!(diff(&s, &t).is_empty(), "{:?}", diff(&s, &t));
    }
}
