//! Controller logs and their replay.
//!
//! A log is JSON lines, one [`LogRecord`] per decision: the interval data the controller was
//! given (after merging everything observed in the interval) and the decision it made. With
//! the configuration, a log is self-contained: [`replay`] feeds the logged inputs to a fresh
//! controller and checks that every decision comes out the same, so each mode's decisions
//! are reproducible from its log (and a tampered log is detected).
//!
//! A log *file* ([`LogFile`]) carries the configuration too: its first line is a
//! [`LogHeader`] (`{"hylics_controller_log":1,"config":{...}}`), then one record per line, so
//! `vmsight hylics replay FILE` needs nothing else.

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, ControllerConfig};
use crate::controller::Controller;
use crate::decision::Decision;
use crate::measurement::Measurement;

/// One line of a controller log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogRecord {
    /// The interval's data as the controller used it.
    pub input: Measurement,
    /// What the controller decided.
    pub decision: Decision,
}

/// A log that could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A record could not be serialized.
    #[error("serializing log record {index}: {source}")]
    Serialize {
        /// Index of the record.
        index: usize,
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },
    /// A line is not a valid record.
    #[error("log line {line}: {source}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The file is empty: no header line.
    #[error("the log is empty (no header line)")]
    NoHeader,
    /// The header names a format version this build does not read.
    #[error("log format version {0} is not supported (this build reads version {LOG_VERSION})")]
    Version(u32),
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The configuration is invalid.
    #[error("replay configuration: {0}")]
    Config(#[from] ConfigError),
    /// The re-run controller decided differently from the log.
    #[error(
        "log record {index} (k = {k}): field {field} is {logged} in the log but the replay gives {replayed}"
    )]
    Mismatch {
        /// Index of the record.
        index: usize,
        /// The logged decision's k.
        k: u64,
        /// The first differing field.
        field: &'static str,
        /// Its logged value (JSON).
        logged: String,
        /// Its replayed value (JSON).
        replayed: String,
    },
}

/// The version written in [`LogHeader::hylics_controller_log`].
pub const LOG_VERSION: u32 = 1;

/// The first line of a log file: what kind of file it is and the configuration the decisions
/// were made with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogHeader {
    /// The log format's version ([`LOG_VERSION`]).
    pub hylics_controller_log: u32,
    /// The controller's configuration.
    pub config: ControllerConfig,
}

impl LogHeader {
    /// The header of a log written by a controller with `config`.
    pub fn new(config: ControllerConfig) -> Self {
        Self {
            hylics_controller_log: LOG_VERSION,
            config,
        }
    }

    /// The header as one JSON line (ending in `\n`).
    pub fn to_line(&self) -> Result<String, LogError> {
        let mut line = serde_json::to_string(self)
            .map_err(|source| LogError::Serialize { index: 0, source })?;
        line.push('\n');
        Ok(line)
    }
}

/// A whole log file: header and records.
#[derive(Debug, Clone, PartialEq)]
pub struct LogFile {
    /// The configuration the decisions were made with.
    pub config: ControllerConfig,
    /// The decisions, in order.
    pub records: Vec<LogRecord>,
}

impl LogFile {
    /// Parses a log file: a [`LogHeader`] line, then records (blank lines are skipped; a last
    /// line cut short by a crash is an error like any other malformed line).
    pub fn parse(text: &str) -> Result<LogFile, LogError> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let Some((i, first)) = lines.next() else {
            return Err(LogError::NoHeader);
        };
        let header: LogHeader = serde_json::from_str(first).map_err(|source| LogError::Parse {
            line: i + 1,
            source,
        })?;
        if header.hylics_controller_log != LOG_VERSION {
            return Err(LogError::Version(header.hylics_controller_log));
        }
        let records = lines
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|source| LogError::Parse {
                    line: i + 1,
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(LogFile {
            config: header.config,
            records,
        })
    }

    /// Re-runs the decisions ([`replay`]) with the logged configuration.
    pub fn replay(&self) -> Result<Vec<Decision>, ReplayError> {
        replay(&self.config, &self.records)
    }
}

/// The records as JSON lines (one per line, each ending in `\n`).
pub fn to_json_lines(records: &[LogRecord]) -> Result<String, LogError> {
    let mut out = String::new();
    for (index, record) in records.iter().enumerate() {
        let line = serde_json::to_string(record)
            .map_err(|source| LogError::Serialize { index, source })?;
        out.push_str(&line);
        out.push('\n');
    }
    Ok(out)
}

/// Parses JSON lines back into records; blank lines are skipped.
pub fn parse_json_lines(text: &str) -> Result<Vec<LogRecord>, LogError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| LogError::Parse {
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Re-runs a controller built from `config` over the logged inputs and checks each decision
/// against the log; returns the replayed decisions.
pub fn replay(
    config: &ControllerConfig,
    records: &[LogRecord],
) -> Result<Vec<Decision>, ReplayError> {
    let mut controller = Controller::new(config.clone())?;
    let mut decisions = Vec::with_capacity(records.len());
    for (index, record) in records.iter().enumerate() {
        let decision = controller.step(record.input.t_secs, record.input.clone());
        if let Some(diff) = record.decision.first_difference(&decision) {
            return Err(ReplayError::Mismatch {
                index,
                k: record.decision.k,
                field: diff.field,
                logged: diff.left,
                replayed: diff.right,
            });
        }
        decisions.push(decision);
    }
    Ok(decisions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::sim::{run_closed_loop, RateSchedule, Workload};
    use crate::testutil::{test_config, test_curve};

    fn logged_run(mode: Mode) -> (ControllerConfig, Vec<LogRecord>) {
        let cfg = test_config(mode);
        let workload = Workload {
            schedule: RateSchedule::Alternating {
                first_rate: 0.5,
                second_rate: 1.0,
                half_period_secs: 900.0,
            },
            true_curve: test_curve(),
            seed: 11,
        };
        let run = run_closed_loop(&cfg, &workload, 3600.0).unwrap();
        (cfg, run.records)
    }

    #[test]
    fn every_mode_replays_from_its_json_log() {
        for mode in Mode::ALL {
            let (cfg, records) = logged_run(mode);
            // In memory the replay is bit-exact.
            let replayed = replay(&cfg, &records).unwrap();
            let logged: Vec<&Decision> = records.iter().map(|r| &r.decision).collect();
            assert_eq!(replayed.iter().collect::<Vec<_>>(), logged, "{mode}");
            // Through JSON (serde_json with float_roundtrip) the replay matches too.
            let text = to_json_lines(&records).unwrap();
            let parsed = parse_json_lines(&text).unwrap();
            assert_eq!(parsed.len(), records.len());
            let replayed = replay(&cfg, &parsed).unwrap();
            for (a, b) in replayed.iter().zip(&logged) {
                assert_eq!(a.first_difference(b), None, "{mode}");
            }
        }
    }

    #[test]
    fn a_tampered_decision_is_detected() {
        let (cfg, mut records) = logged_run(Mode::Combined);
        records[5].decision.m_after_bytes += 4096;
        match replay(&cfg, &records) {
            Err(ReplayError::Mismatch { index, field, .. }) => {
                assert_eq!((index, field), (5, "m_after_bytes"));
            }
            other => panic!("tampering not detected: {other:?}"),
        }
    }

    #[test]
    fn a_tampered_input_is_detected() {
        let (cfg, mut records) = logged_run(Mode::AdaptiveOnly);
        records[3].input.response_times_secs.push(100.0);
        let err = replay(&cfg, &records).unwrap_err();
        assert!(
            matches!(err, ReplayError::Mismatch { index: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn replay_with_another_configuration_fails() {
        let (mut cfg, records) = logged_run(Mode::QueueingOnly);
        cfg.mode = Mode::Combined;
        assert!(matches!(
            replay(&cfg, &records),
            Err(ReplayError::Mismatch {
                index: 0,
                field: "mode",
                ..
            })
        ));
    }

    #[test]
    fn a_log_file_carries_its_configuration_and_replays() {
        let (cfg, records) = logged_run(Mode::Combined);
        let mut text = LogHeader::new(cfg.clone()).to_line().unwrap();
        text.push_str(&to_json_lines(&records).unwrap());
        let file = LogFile::parse(&text).unwrap();
        assert_eq!(file.config, cfg);
        assert_eq!(file.records.len(), records.len());
        assert_eq!(file.replay().unwrap().len(), records.len());
        assert!(matches!(LogFile::parse(""), Err(LogError::NoHeader)));
        let future = text.replacen(
            "\"hylics_controller_log\":1",
            "\"hylics_controller_log\":9",
            1,
        );
        assert!(matches!(LogFile::parse(&future), Err(LogError::Version(9))));
        // A record line cut short (a crash mid-write) is reported with its line number.
        let cut = &text[..text.len() - 20];
        let n = cut.lines().count();
        assert!(matches!(LogFile::parse(cut), Err(LogError::Parse { line, .. }) if line == n));
        // Records without a header are not a log file.
        assert!(LogFile::parse(&to_json_lines(&records).unwrap()).is_err());
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let (_, records) = logged_run(Mode::Static);
        let mut text = to_json_lines(&records[..2]).unwrap();
        text.push_str("\n{not json}\n");
        assert!(matches!(
            parse_json_lines(&text),
            Err(LogError::Parse { line: 4, .. })
        ));
    }
}
