//! vmsight-blockdev (skeleton; filled in by its owner).
