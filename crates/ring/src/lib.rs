//! vmsight-ring (skeleton; filled in by its owner).
