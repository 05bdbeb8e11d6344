//! Two-level predictor scheduling (../shared/DESIGN.md §4.6): the **offline** set (layers that exit often on
//! calibration data) is always evaluated; once `window` tokens have exited early, the **online** set adds
//! `e + offset` for each of the last `window` exit layers `e` (offsets −2, 0, +2 by default). Evaluating only
//! these layers keeps predictor calls (a final norm, four head rows and a small MLP each) rare.

use super::predictor::ScheduleConfig;
use std::collections::VecDeque;

/// Which layers evaluate their predictor for the next token.
#[derive(Clone, Debug)]
pub struct Scheduler {
    config: ScheduleConfig,
    n_layers: usize,
    /// Layers that have a predictor.
    available: Vec<bool>,
    /// Whether to use the online level.
    online: bool,
    recent: VecDeque<usize>,
    active: Vec<bool>,
}

impl Scheduler {
    /// A scheduler over `n_layers` layers, `available[i]` telling whether layer `i` has a predictor.
    pub fn new(config: ScheduleConfig, available: Vec<bool>, online: bool) -> Scheduler {
        let n_layers = available.len();
        let mut s = Scheduler { config, n_layers, available, online, recent: VecDeque::new(), active: Vec::new() };
        s.rebuild();
        s
    }

    /// Whether layer `il` evaluates its predictor.
    pub fn is_active(&self, il: usize) -> bool {
        self.active.get(il).copied().unwrap_or(false)
    }

    /// Number of active layers.
    pub fn n_active(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// Records that a token exited early at layer `il`.
    pub fn record_exit(&mut self, il: usize) {
        if !self.online || self.config.window == 0 {
            return;
        }
        if self.recent.len() == self.config.window {
            self.recent.pop_front();
        }
        self.recent.push_back(il);
        self.rebuild();
    }

    /// Forgets the online history (a new sequence).
    pub fn reset(&mut self) {
        self.recent.clear();
        self.rebuild();
    }

    fn rebuild(&mut self) {
        self.active.clear();
        self.active.resize(self.n_layers, false);
        for &l in &self.config.offline {
            if l < self.n_layers {
                self.active[l] = true;
            }
        }
        if self.online && self.config.window > 0 && self.recent.len() >= self.config.window {
            for &e in &self.recent {
                for &o in &self.config.offsets {
                    let l = e as i64 + o as i64;
                    if (0..self.n_layers as i64).contains(&l) {
                        self.active[l as usize] = true;
                    }
                }
            }
        }
        for (a, &ok) in self.active.iter_mut().zip(&self.available) {
            *a &= ok;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn online_layers_join_after_a_full_window_of_exits() {
        let config = ScheduleConfig { offline: vec![10, 12], window: 3, offsets: vec![-2, 0, 2] };
        let mut available = vec![true; 20];
        available[19] = false;
        let mut s = Scheduler::new(config, available, true);
        assert_eq!((0..20).filter(|&l| s.is_active(l)).collect::<Vec<_>>(), vec![10, 12]);
        s.record_exit(5);
        s.record_exit(5);
        assert_eq!(s.n_active(), 2, "window not full yet");
        s.record_exit(18);
        assert_eq!((0..20).filter(|&l| s.is_active(l)).collect::<Vec<_>>(), vec![3, 5, 7, 10, 12, 16, 18]);
        s.record_exit(18);
        s.record_exit(18);
        s.record_exit(1);
        // Window is now [18, 18, 1]: 5 and 7 leave, -1 is out of range, 20 and 19 have no predictor.
        assert_eq!((0..20).filter(|&l| s.is_active(l)).collect::<Vec<_>>(), vec![1, 3, 10, 12, 16, 18]);
        s.reset();
        assert_eq!(s.n_active(), 2);
    }

    #[test]
    fn offline_only_when_online_is_off() {
        let config = ScheduleConfig { offline: vec![1], window: 1, offsets: vec![0] };
        let mut s = Scheduler::new(config, vec![true; 4], false);
        s.record_exit(2);
        assert!(!s.is_active(2) && s.is_active(1));
    }
}
