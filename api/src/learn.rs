//! A worker's engine model learned online (README, "Cost"): its own time to first token as a
//! linear function of what a decision knows,
//!
//! ```text
//! own_ms = step_ms + uncached_ktokens * ms_per_ktoken + running * running_ms + others * waiting_ms
//! ```
//!
//! fitted by recursive least squares with forgetting, starting from the configured cost model
//! as a weak prior (each term's spread the configured figure itself). The predictor (`crate::predict`) feeds it
//! the first tokens of requests routed to a quiet engine (nothing of its own ahead there,
//! nobody else's waiting), so the fit is the engine's own speed, and uses it where it
//! predicted better than the configured figures calibrated.

/// The fitted terms, in the order of [`Features`].
pub const TERMS: usize = 4;

/// What a decision knew of one worker: 1 (the step), uncached prompt tokens in thousands,
/// requests running there, requests waiting there that this replica did not route.
pub type Features = [f64; TERMS];

/// Older observations weigh this much less per newer one (about the last 200 count).
const FORGET: f64 = 0.995;
/// How far the prior may be off, as a share of each configured figure (at least
/// [`PRIOR_FLOOR_MS`]), over the spread of one observation: a weak prior (a term of 20 ms
/// weighs a quarter of an observation, one of 125 ms under a hundredth), which the first
/// reports override.
const PRIOR_SPREAD: f64 = 1.0;
const PRIOR_FLOOR_MS: f64 = 10.0;
/// An observation's spread (ms): the unit the covariance is kept in.
const NOISE_MS: f64 = 10.0;
/// An observed own time above this is left out (a stalled stream says nothing of speed).
pub const MAX_OWN_MS: f64 = 60_000.0;

/// One worker's fit.
#[derive(Debug, Clone)]
pub struct EngineFit {
    theta: Features,
    /// Covariance over the observation spread, symmetric.
    p: [[f64; TERMS]; TERMS],
    /// Its diagonal at the start: no direction grows less certain than the prior was (a
    /// term that never varies would otherwise wind up under forgetting).
    p_max: Features,
    observations: u64,
}

impl EngineFit {
    /// A fit that starts at `prior` (each term's configured value).
    pub fn new(prior: Features) -> Self {
        let mut p = [[0.0; TERMS]; TERMS];
        let mut p_max = [0.0; TERMS];
        for i in 0..TERMS {
            let spread = (prior[i].abs() * PRIOR_SPREAD).max(PRIOR_FLOOR_MS) / NOISE_MS;
            p[i][i] = spread * spread;
            p_max[i] = p[i][i];
        }
        Self {
            theta: prior,
            p,
            p_max,
            observations: 0,
        }
    }

    /// Folds in one first token: `own_ms` observed with features `x`.
    pub fn observe(&mut self, x: &Features, own_ms: f64) {
        if !(0.0..=MAX_OWN_MS).contains(&own_ms) || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let y = own_ms;
        let px = mul(&self.p, x);
        let denominator = FORGET + dot(x, &px);
        if !(denominator.is_finite() && denominator > 0.0) {
            return;
        }
        let gain = px.map(|v| v / denominator);
        let error = y - dot(&self.theta, x);
        for (t, g) in self.theta.iter_mut().zip(gain) {
            *t += g * error;
        }
        for (row, g) in self.p.iter_mut().zip(gain) {
            for (v, pxj) in row.iter_mut().zip(px) {
                *v = (*v - g * pxj) / FORGET;
            }
        }
        // Symmetric again (rounding), each direction no less certain than at the start.
        for i in 0..TERMS {
            for j in 0..i {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        for i in 0..TERMS {
            if self.p[i][i] > self.p_max[i] {
                let s = (self.p_max[i] / self.p[i][i]).sqrt();
                for j in 0..TERMS {
                    self.p[i][j] *= s;
                    self.p[j][i] *= s;
                }
            }
        }
        self.observations += 1;
    }

    /// The predicted own time for `x`; no term below zero (a fit may wander there while a
    /// feature barely varies).
    pub fn predict(&self, x: &Features) -> f64 {
        self.theta.iter().zip(x).map(|(t, v)| t.max(0.0) * v).sum()
    }

    /// The terms as fitted.
    pub fn terms(&self) -> Features {
        self.theta
    }

    pub fn observations(&self) -> u64 {
        self.observations
    }
}

fn dot(a: &Features, b: &Features) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn mul(m: &[[f64; TERMS]; TERMS], v: &Features) -> Features {
    std::array::from_fn(|i| dot(&m[i], v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weighted ridge least squares solved outright: the prior as pseudo-observations, the
    /// i-th of n observations weighing FORGET^(n-1-i), the prior FORGET^n.
    fn batch(prior: &Features, obs: &[(Features, f64)]) -> Features {
        let n = obs.len() as i32;
        let mut a = [[0.0; TERMS]; TERMS];
        let mut b = [0.0; TERMS];
        let fit = EngineFit::new(*prior);
        for i in 0..TERMS {
            let w = FORGET.powi(n) / fit.p[i][i];
            a[i][i] += w;
            b[i] += w * prior[i];
        }
        for (k, (x, y)) in obs.iter().enumerate() {
            let w = FORGET.powi(n - 1 - k as i32);
            for i in 0..TERMS {
                for j in 0..TERMS {
                    a[i][j] += w * x[i] * x[j];
                }
                b[i] += w * x[i] * y;
            }
        }
        solve(a, b)
    }

    /// Gaussian elimination with partial pivoting.
    fn solve(mut a: [[f64; TERMS]; TERMS], mut b: Features) -> Features {
        for c in 0..TERMS {
            let p = (c..TERMS)
                .max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))
                .unwrap();
            a.swap(c, p);
            b.swap(c, p);
            for r in c + 1..TERMS {
                let f = a[r][c] / a[c][c];
                let pivot = a[c];
                for (v, pk) in a[r].iter_mut().zip(pivot).skip(c) {
                    *v -= f * pk;
                }
                b[r] -= f * b[c];
            }
        }
        let mut x = [0.0; TERMS];
        for r in (0..TERMS).rev() {
            let s: f64 = (r + 1..TERMS).map(|k| a[r][k] * x[k]).sum();
            x[r] = (b[r] - s) / a[r][r];
        }
        x
    }

    /// Seeded observations of an engine with `truth`, every term varying.
    fn observations(truth: &Features, n: usize) -> Vec<(Features, f64)> {
        let mut s = 7u64;
        let mut next = move |m: f64| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as f64 / f64::from(1u32 << 31) * m
        };
        (0..n)
            .map(|_| {
                let x = [1.0, next(4.0), next(6.0).floor(), next(3.0).floor()];
                let noise = next(4.0) - 2.0;
                (x, dot(truth, &x) + noise)
            })
            .collect()
    }

    #[test]
    fn the_online_fit_is_the_weighted_least_squares_fit_of_everything_seen() {
        let prior = [20.0, 125.0, 5.0, 250.0];
        let obs = observations(&[42.0, 10.0, 3.0, 60.0], 60);
        let mut fit = EngineFit::new(prior);
        for (x, y) in &obs {
            fit.observe(x, *y);
        }
        let oracle = batch(&prior, &obs);
        // Equal but for the first few updates, where a direction not yet observed is held at
        // the prior's certainty (the oracle forgets the prior a little meanwhile).
        for (online, exact) in fit.terms().iter().zip(oracle) {
            assert!(
                (online - exact).abs() < 1e-3 * exact.abs().max(1.0),
                "{online} {exact}"
            );
        }
    }

    #[test]
    fn an_engine_off_its_prior_is_learned_from_its_first_tokens() {
        let truth = [42.0, 10.0, 3.0, 60.0];
        let mut fit = EngineFit::new([20.0, 125.0, 5.0, 250.0]);
        let obs = observations(&truth, 300);
        for (x, y) in &obs {
            fit.observe(x, *y);
        }
        for (x, _) in obs.iter().take(20) {
            let ratio = (dot(&truth, x)) / fit.predict(x);
            assert!((0.95..1.05).contains(&ratio), "{ratio}");
        }
        assert_eq!(fit.observations(), 300);
    }

    #[test]
    fn a_term_that_never_varies_stays_bounded_and_the_rest_is_still_learned() {
        let mut fit = EngineFit::new([20.0, 125.0, 5.0, 250.0]);
        // Nobody else ever waits there: the last term is never excited.
        for (mut x, _) in observations(&[0.0; TERMS], 2_000) {
            x[3] = 0.0;
            let y = 42.0 + 10.0 * x[1] + 3.0 * x[2];
            fit.observe(&x, y);
        }
        let t = fit.terms();
        assert!(t.iter().all(|v| v.is_finite()));
        assert!(
            (t[1] - 10.0).abs() < 0.5 && (t[0] - 42.0).abs() < 2.0,
            "{t:?}"
        );
        for i in 0..TERMS {
            assert!(fit.p[i][i] <= fit.p_max[i] * (1.0 + 1e-9));
        }
    }

    #[test]
    fn nonsense_observations_change_nothing() {
        let mut fit = EngineFit::new([20.0, 125.0, 5.0, 250.0]);
        fit.observe(&[1.0, f64::NAN, 0.0, 0.0], 10.0);
        fit.observe(&[1.0, 1.0, 0.0, 0.0], f64::INFINITY);
        assert_eq!(fit.observations(), 0);
        assert_eq!(fit.terms(), [20.0, 125.0, 5.0, 250.0]);
    }
}
