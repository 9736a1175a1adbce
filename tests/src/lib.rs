//! Helpers for real-guest integration tests.
