//! Fixtures shared by the unit tests.

use crate::config::{ControllerConfig, Mode, MIB};
use crate::rls::ModelOrders;
use crate::service::{ServiceCurve, ServicePoint};

/// E[X|m] = 0.4 + 102.4/m (m in MiB): 2.0 s at 64 MiB down to 0.5 s at 1 GiB, sampled at the
/// sizes a measurement script might use (the "extended inversely proportional" shape of §6.4).
pub fn test_curve() -> ServiceCurve {
    curve_scaled(1.0)
}

/// [`test_curve`] with every service time multiplied by `factor`.
pub fn curve_scaled(factor: f64) -> ServiceCurve {
    let points = [64u64, 96, 128, 192, 256, 384, 512, 768, 1024]
        .into_iter()
        .map(|mib| ServicePoint {
            m_bytes: mib * MIB,
            service_secs: factor * (0.4 + 102.4 / mib as f64),
        })
        .collect();
    ServiceCurve::new(points).unwrap()
}

/// A configuration over [`test_curve`]: τ = 3 s, R_thresh = 1.5 s, m_thresh = 16 MiB,
/// ci in [30, 240] s starting at 60 s, m in [64 MiB, 1 GiB] starting at 128 MiB.
pub fn test_config(mode: Mode) -> ControllerConfig {
    ControllerConfig {
        mode,
        tau_secs: 3.0,
        r_thresh_secs: 1.5,
        m_thresh_bytes: 16 * MIB,
        ci_min_secs: 30.0,
        ci_max_secs: 240.0,
        ci_initial_secs: 60.0,
        m_min_bytes: 64 * MIB,
        m_max_bytes: 1024 * MIB,
        m_initial_bytes: 128 * MIB,
        f0: 100.0,
        theta0: vec![1.0, -0.05],
        orders: ModelOrders::HYLICS,
        rls_unit_bytes: MIB,
        b0_min: 1e-9,
        forgetting: 1.0,
        b0_max: None,
        adaptive_after_reset: true,
        curve: test_curve(),
    }
}
