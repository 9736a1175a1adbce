//! Insights about one block request and the insight-log records: defined in
//! [`vmsight_proto::insight`] (they cross a process boundary: `vmsight run --insights` writes
//! them, `vmsight report` reads them) and re-exported here so that the pipeline and its users
//! keep their paths.

pub use vmsight_proto::insight::{
    BlockRecord, Content, DedupHint, FileRecord, InsightRecord, Pattern, RequestInsight,
    CLASS_DEFAULT, CLASS_METADATA, CLASS_SKIP_DEDUP,
};
