//! vmsight TCG plugin (skeleton).
