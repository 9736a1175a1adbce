//! Tests of the asynchronous pipeline with controllable stages.

use super::*;
use crate::request::{RequestKind, Segment};
use crate::stages::FlushOrder;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// A stage that holds every request whose sector (or, for writes, every write if
/// `writes` is set) matches until the test releases it; everything else passes.
#[derive(Default)]
pub(crate) struct Hold {
    pub(crate) sector: Option<u64>,
    pub(crate) writes: bool,
    pub(crate) held: Mutex<Vec<Io>>,
    /// `release()` fails what is held instead of passing it on.
    pub(crate) fail_on_release: bool,
}

impl Hold {
    pub(crate) fn sector(s: u64) -> Self {
        Self {
            sector: Some(s),
            ..Self::default()
        }
    }

    pub(crate) fn writes() -> Self {
        Self {
            writes: true,
            ..Self::default()
        }
    }

    pub(crate) fn held(&self) -> usize {
        self.held.lock().expect("held").len()
    }

    /// Passes every held request on.
    pub(crate) fn let_go(&self) {
        let held: Vec<Io> = std::mem::take(&mut *self.held.lock().expect("held"));
        for io in held {
            io.forward();
        }
    }
}

impl Stage for Hold {
    fn name(&self) -> &str {
        "hold"
    }
    fn submit(&self, io: Io) {
        let r = io.request();
        let hold = self.sector == Some(r.sector) && r.kind != RequestKind::Flush
            || self.writes && r.kind == RequestKind::Write;
        if hold {
            self.held.lock().expect("held").push(io);
        } else {
            io.forward();
        }
    }
    fn release(&self) {
        let held: Vec<Io> = std::mem::take(&mut *self.held.lock().expect("held"));
        for io in held {
            if self.fail_on_release {
                io.complete(Ok(Status::IoErr));
            } else {
                io.forward();
            }
        }
    }
}

/// Shares a stage between the pipeline and the test.
pub(crate) struct Shared<S>(pub(crate) Arc<S>);
impl<S: Stage> Stage for Shared<S> {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn submit(&self, io: Io) {
        self.0.submit(io)
    }
    fn release(&self) {
        self.0.release()
    }
}

/// A terminal that logs what reaches it and answers OK.
struct LogTerminal {
    log: Arc<Mutex<Vec<String>>>,
}
impl Terminal for LogTerminal {
    fn name(&self) -> &str {
        "terminal"
    }
    fn execute(&mut self, req: &mut Request) -> IoResult {
        self.log
            .lock()
            .expect("log")
            .push(format!("{:?}@{}", req.kind, req.sector));
        Ok(Status::Ok)
    }
}

/// Records the order in which stages see requests on the way down and up.
struct Recorder {
    name: &'static str,
    log: Arc<Mutex<Vec<String>>>,
}
impl Stage for Recorder {
    fn name(&self) -> &str {
        self.name
    }
    fn submit(&self, io: Io) {
        self.log
            .lock()
            .expect("log")
            .push(format!("{}:before", self.name));
        let log = self.log.clone();
        let name = self.name;
        io.forward_then(move |io, r| {
            log.lock().expect("log").push(format!("{name}:after"));
            io.complete(r);
        });
    }
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).expect("guest memory")
}

fn req(m: &GuestMemoryMmap, kind: RequestKind, sector: u64) -> Request {
    let segs = match kind {
        RequestKind::Read | RequestKind::Write => vec![Segment {
            addr: GuestAddress(0x1000),
            len: 512,
        }],
        _ => Vec::new(),
    };
    let mut r = Request::new_for_test(m, kind, sector, segs);
    r.id = sector;
    r
}

/// Submits `r`; the receiver gets (request id, result) once it completes.
fn submit(p: &Pipeline, r: Request, tx: &mpsc::Sender<(u64, IoResult)>) {
    let tx = tx.clone();
    p.submit(r, move |r, res| {
        let _ = tx.send((r.id, res));
    });
}

fn log_pipeline() -> (Pipeline, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let p = Pipeline::new(Box::new(LogTerminal { log: log.clone() }));
    (p, log)
}

/// Waits (bounded) until `hold` holds `n` requests.
pub(crate) fn wait_held(hold: &Hold, n: usize) {
    for _ in 0..1000 {
        if hold.held() == n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the stage never held {n} requests (holds {})", hold.held());
}

fn no_more(rx: &Receiver<(u64, IoResult)>) -> bool {
    rx.recv_timeout(Duration::from_millis(50)).is_err()
}

#[test]
fn stages_run_in_order_around_the_terminal() {
    let (mut p, log) = log_pipeline();
    for name in ["a", "b"] {
        p.push(Box::new(Recorder {
            name,
            log: log.clone(),
        }))
        .expect("push");
    }
    assert_eq!(p.stage_names(), vec!["a", "b", "terminal"]);
    let m = mem();
    let mut r = req(&m, RequestKind::Flush, 0);
    assert_eq!(p.run(&mut r).expect("run"), Status::Ok);
    assert_eq!(
        *log.lock().expect("log"),
        vec!["a:before", "b:before", "Flush@0", "b:after", "a:after"]
    );
}

/// Serves reads of sector 7 itself, without the terminal.
struct ShortCircuit;
impl Stage for ShortCircuit {
    fn name(&self) -> &str {
        "short-circuit"
    }
    fn submit(&self, io: Io) {
        let r = io.request();
        if r.kind == RequestKind::Read && r.sector == 7 {
            let res = r.write_data(0, &[0xab; 512]).map(|()| Status::Ok);
            io.complete(res);
        } else {
            io.forward();
        }
    }
}

#[test]
fn a_stage_can_answer_without_the_terminal() {
    let (mut p, log) = log_pipeline();
    p.push(Box::new(ShortCircuit)).expect("push");
    let m = mem();
    let mut r = req(&m, RequestKind::Read, 7);
    assert_eq!(p.run(&mut r).expect("run"), Status::Ok);
    assert!(log.lock().expect("log").is_empty());
    let mut buf = [0u8; 512];
    m.read_slice(&mut buf, GuestAddress(0x1000)).expect("read");
    assert!(buf.iter().all(|&b| b == 0xab));
    let mut r = req(&m, RequestKind::Read, 8);
    assert_eq!(p.run(&mut r).expect("run"), Status::Ok);
    assert_eq!(log.lock().expect("log").len(), 1);
}

#[test]
fn a_held_request_does_not_delay_later_requests() {
    let (mut p, log) = log_pipeline();
    let hold = Arc::new(Hold::sector(7));
    p.push(Box::new(Shared(hold.clone()))).expect("push");
    let m = mem();
    let (tx, rx) = channel();
    submit(&p, req(&m, RequestKind::Read, 7), &tx);
    for s in [1u64, 2, 3] {
        submit(&p, req(&m, RequestKind::Read, s), &tx);
    }
    // The three later requests complete while the first is still held.
    let mut done: Vec<u64> = (0..3).map(|_| rx.recv().expect("done").0).collect();
    done.sort_unstable();
    assert_eq!(done, vec![1, 2, 3]);
    assert_eq!(hold.held(), 1);
    assert!(no_more(&rx));
    hold.let_go();
    let (id, res) = rx.recv().expect("held one completes");
    assert_eq!((id, res.expect("ok")), (7, Status::Ok));
    assert_eq!(
        log.lock().expect("log").last().map(String::as_str),
        Some("Read@7")
    );
}

#[test]
fn flush_waits_for_writes_submitted_before_it() {
    let (mut p, log) = log_pipeline();
    let hold = Arc::new(Hold::writes());
    p.push(Box::new(FlushOrder::new())).expect("push");
    p.push(Box::new(Shared(hold.clone()))).expect("push");
    let m = mem();
    let (tx, rx) = channel();
    submit(&p, req(&m, RequestKind::Write, 10), &tx);
    submit(&p, req(&m, RequestKind::Flush, 0), &tx);
    // Reads are not held behind the flush.
    submit(&p, req(&m, RequestKind::Read, 20), &tx);
    assert_eq!(rx.recv().expect("read").0, 20);
    assert!(no_more(&rx), "the flush must wait for the write");
    assert_eq!(*log.lock().expect("log"), vec!["Read@20"]);
    hold.let_go();
    let order: Vec<u64> = (0..2).map(|_| rx.recv().expect("done").0).collect();
    assert_eq!(order, vec![10, 0]);
    assert_eq!(
        *log.lock().expect("log"),
        vec!["Read@20", "Write@10", "Flush@0"]
    );
}

#[test]
fn flush_does_not_wait_for_writes_submitted_after_it() {
    let (mut p, _log) = log_pipeline();
    let hold = Arc::new(Hold::writes());
    p.push(Box::new(FlushOrder::new())).expect("push");
    p.push(Box::new(Shared(hold.clone()))).expect("push");
    let m = mem();
    let (tx, rx) = channel();
    submit(&p, req(&m, RequestKind::Flush, 0), &tx);
    submit(&p, req(&m, RequestKind::Write, 10), &tx);
    assert_eq!(rx.recv().expect("flush").0, 0);
    assert_eq!(hold.held(), 1);
    hold.let_go();
    assert_eq!(rx.recv().expect("write").0, 10);
}

#[test]
fn release_completes_every_held_request_exactly_once() {
    for fail in [false, true] {
        let (mut p, _log) = log_pipeline();
        let hold = Arc::new(Hold {
            writes: true,
            fail_on_release: fail,
            ..Hold::default()
        });
        p.push(Box::new(FlushOrder::new())).expect("push");
        p.push(Box::new(Shared(hold.clone()))).expect("push");
        let m = mem();
        let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..8).map(|_| AtomicUsize::new(0)).collect());
        let (tx, rx) = channel();
        for id in 0..8u64 {
            let kind = if id == 5 {
                RequestKind::Flush
            } else {
                RequestKind::Write
            };
            let mut r = req(&m, kind, id);
            r.id = id;
            let counts = counts.clone();
            let tx = tx.clone();
            p.submit(r, move |r, res| {
                counts[r.id as usize].fetch_add(1, Ordering::SeqCst);
                let _ = tx.send((r.id, res));
            });
        }
        assert_eq!(hold.held(), 7);
        p.release();
        let mut results: Vec<(u64, IoResult)> = (0..8).map(|_| rx.recv().expect("done")).collect();
        results.sort_by_key(|r| r.0);
        assert!(no_more(&rx));
        for (id, res) in results {
            let want = if fail && id != 5 {
                Status::IoErr
            } else {
                Status::Ok
            };
            assert_eq!(res.expect("result"), want, "request {id} (fail={fail})");
        }
        assert!(counts.iter().all(|c| c.load(Ordering::SeqCst) == 1));
    }
}

/// A buggy stage that loses every request.
struct Loser;
impl Stage for Loser {
    fn name(&self) -> &str {
        "loser"
    }
    fn submit(&self, io: Io) {
        drop(io);
    }
}

#[test]
fn a_dropped_request_fails_once_naming_the_stage() {
    let (mut p, log) = log_pipeline();
    p.push(Box::new(Recorder {
        name: "above",
        log: log.clone(),
    }))
    .expect("push");
    p.push(Box::new(Loser)).expect("push");
    let m = mem();
    let mut r = req(&m, RequestKind::Read, 1);
    let e = p.run(&mut r).expect_err("dropped");
    assert!(
        matches!(&e, StageError::Dropped { stage } if stage == "loser"),
        "{e}"
    );
    // The stage above still saw the completion, and the request came back intact.
    assert_eq!(
        *log.lock().expect("log"),
        vec!["above:before", "above:after"]
    );
    assert_eq!(r.sector, 1);
}

/// A synchronous stage that reads the block before every write (two I/Os per request).
struct ReadBeforeWrite {
    seen: Arc<Mutex<Vec<String>>>,
}
impl SyncStage for ReadBeforeWrite {
    fn name(&self) -> &str {
        "rbw"
    }
    fn process(&mut self, req: &mut Request, next: &mut dyn Next) -> IoResult {
        if req.kind == RequestKind::Write {
            let mut probe = Request::new_for_test(
                req.memory(),
                RequestKind::Read,
                req.sector,
                req.segments.clone(),
            );
            next.run(&mut probe)?;
        }
        let st = next.run(req)?;
        self.seen
            .lock()
            .expect("seen")
            .push(format!("{:?}@{}", req.kind, req.sector));
        Ok(st)
    }
    fn shutdown(&mut self, next: &mut dyn Next) -> Result<(), StageError> {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1000)]).expect("mem");
        let mut f = Request::new_for_test(&m, RequestKind::Flush, 99, Vec::new());
        next.run(&mut f).map(|_| ())
    }
}

#[test]
fn a_serialized_stage_runs_its_own_io_through_asynchronous_stages_below() {
    let (mut p, log) = log_pipeline();
    let seen = Arc::new(Mutex::new(Vec::new()));
    p.push(Box::new(
        Serialized::new(ReadBeforeWrite { seen: seen.clone() }).expect("thread"),
    ))
    .expect("push");
    let hold = Arc::new(Hold::sector(3));
    p.push(Box::new(Shared(hold.clone()))).expect("push");
    let m = mem();
    let (tx, rx) = channel();
    submit(&p, req(&m, RequestKind::Write, 3), &tx);
    submit(&p, req(&m, RequestKind::Write, 4), &tx);
    // The first write's probe read is held below; the serialized stage waits for it, so the
    // second write waits too (one request at a time in a serialized stage).
    assert!(no_more(&rx));
    hold.let_go(); // the probe
    wait_held(&hold, 1);
    hold.let_go(); // the write itself
    let order: Vec<u64> = (0..2).map(|_| rx.recv().expect("done").0).collect();
    assert_eq!(order, vec![3, 4]);
    assert_eq!(
        *log.lock().expect("log"),
        vec!["Read@3", "Write@3", "Read@4", "Write@4"]
    );
    p.shutdown().expect("shutdown");
    assert_eq!(
        log.lock().expect("log").last().map(String::as_str),
        Some("Flush@99")
    );
    assert_eq!(seen.lock().expect("seen").len(), 2);
}

#[test]
fn stages_cannot_be_added_once_requests_run() {
    let (mut p, _log) = log_pipeline();
    let m = mem();
    let (tx, _rx) = channel();
    let hold = Arc::new(Hold::sector(1));
    p.push(Box::new(Shared(hold.clone()))).expect("push");
    submit(&p, req(&m, RequestKind::Read, 1), &tx);
    let e = p.push(Box::new(ShortCircuit)).expect_err("running");
    assert!(e.to_string().contains("before the pipeline runs"), "{e}");
    hold.let_go();
}

#[test]
fn status_bytes_match_the_spec() {
    assert_eq!(Status::Ok.as_u8(), 0);
    assert_eq!(Status::IoErr.as_u8(), 1);
    assert_eq!(Status::Unsupp.as_u8(), 2);
}
