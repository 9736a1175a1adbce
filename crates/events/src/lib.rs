//! vmsight-events: delivery of the file-system events inferred from guest disks
//! (DS-VMI / Gamma-Ray §IV-A, issue 5 part 4).
//!
//! Every event becomes a [`Message`] addressed by the channel `host:vm:/guest/path` and
//! numbered per VM ([`Addresser`]). Two transports carry the same JSON lines:
//! - the embedded [`EventBus`], a Unix socket in the VM's runtime directory
//!   (`<runtime>/<vm>/events.sock`) that [`watch`] (`vmsight watch`) subscribes to;
//! - [`RedisPublisher`], Redis pub/sub for monitors on other hosts (`PSUBSCRIBE` with
//!   [`Pattern::to_redis_glob`]).
//!
//! Subscriptions are [`Pattern`]s (Gamma-Ray Table I: `*:*:/var/log/*`).

mod bus;
mod message;
mod pattern;
mod redis_pub;
mod watch;

pub use bus::{
    subscribe, BusError, BusStats, EventBus, HandshakeError, SubscribeRequest, DEFAULT_CLIENT_QUEUE,
};
pub use message::{host_name, now_ns, Addresser, DecodeError, Message, Notice, StreamItem};
pub use pattern::{any_matches, Pattern, PatternError, MAX_PATTERN_LEN};
pub use redis_pub::{RedisError, RedisPublisher, RedisStats, DEFAULT_REDIS_QUEUE};
pub use watch::{
    readable, running_vms, runtime_base, watch, RunningVm, WatchOptions, EVENTS_SOCKET,
};
